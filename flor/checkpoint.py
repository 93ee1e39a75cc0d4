"""Checkpoint files: flor.save, flor.load and in-place flor.restore.

The file format is written and read by the C core (see docs/FORMAT.md); this
module turns its raw results into PyTorch-style behaviour and clear errors.
"""
from __future__ import annotations

import os
import random
import sys
from collections.abc import Mapping

from . import _core, trust
from .errors import CheckpointCorrupt, CheckpointWriteError
from .handles import Handle

__all__ = ["save", "load", "restore"]


def save(obj, path) -> None:
    """Write ``obj`` to ``path`` atomically: temp file, fsync, rename, fsync of
    the directory.  A crash at any moment leaves either the old file or the
    complete new one under ``path``, never a partial one.  The file is signed
    with the user's key (see :mod:`flor.trust`)."""
    path = os.fspath(path)
    _nbytes, err, step = _core.save(obj, path, None, trust.signer(strict=False))
    if err:
        raise CheckpointWriteError([(path, err, step, "")])


def _location_hook(map_location, path=""):
    """Return hook(storage, recorded_device) -> storage, as torch.load does.

    torch is imported when the hook first runs, which is only for files that
    hold tensors."""
    if callable(map_location):
        def call(storage, recorded):
            try:
                return map_location(storage, recorded)
            except Exception as e:
                raise trust.HookFailed() from e
        return call

    def move(storage, recorded):
        try:
            return _move(storage, recorded)
        except _core.FormatError:
            raise
        except Exception as e:
            raise trust.HookFailed() from e

    def _move(storage, recorded):
        import torch

        if map_location is None:
            target = recorded
        elif isinstance(map_location, Mapping):
            target = map_location.get(recorded, recorded)
        elif isinstance(map_location, (str, torch.device)):
            target = map_location
        else:
            raise TypeError(
                "map_location must be None, a device, a dict or a callable, "
                f"not {type(map_location).__name__}"
            )
        device = torch.device(target)  # the reader checked recorded names
        if device.type == "cpu":
            return storage
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"the checkpoint holds tensors from {recorded} but CUDA is not available "
                "here; pass map_location='cpu' to load them on the CPU"
            )
        try:
            return storage.to(device=device)
        except Exception as e:
            if target != recorded:
                raise
            # A device type this torch cannot reach, named by the file itself.
            raise _core.FormatError(
                path, "tensor table", f"the recorded device {recorded!r} cannot be used here "
                f"({type(e).__name__}: {e}); pass map_location='cpu'") from None

    return move


def load(path, map_location=None, *, trusted=False):
    """Read a checkpoint written by :func:`save` or a :class:`Materializer`.

    Every section is checked against its CRC-32C before use (each blob of
    tensor data when it is first used); a damaged or truncated file raises
    :class:`CheckpointCorrupt` naming the file and the section.  Tensor data is
    memory-mapped (copy-on-write), not copied.

    Loading is safe by default, as ``torch.load(weights_only=True)``: only
    containers, numbers, strings, tensors, arrays and torch dtypes, devices and
    sizes load, and a file that names anything else raises
    :class:`flor.UnsafeCheckpoint` before any of it runs.  Pass
    ``trusted=True`` to load other objects (classes of your script, objects
    saved by their ``__reduce__``): that runs whatever code the file names, so
    do it only for files you trust.

    ``map_location`` works as in ``torch.load``: ``None`` puts tensors back on
    the device they were saved from, a device moves all of them there, a dict
    maps recorded device names to new ones, and a callable
    ``f(storage, recorded_device) -> storage`` decides per storage.
    Objects saved through ``state_dict()`` load as their state dict.
    """
    return read(path, map_location, bool(trusted))


def read(path, map_location=None, trusted=False, expect_tag=None, seen=None, sealed=False):
    """:func:`load` with flor's own choices: ``trusted`` may be "signed" (the
    full unpickler for files signed with the user's key, the safe one for the
    rest); ``expect_tag`` refuses a file made for something else
    (:class:`flor.trust.Mismatch`) before anything is unpickled; ``seen``
    receives how the file was read; ``sealed``: the user's key signed the
    file's run, so a file whose signature is missing or does not verify is
    refused (:class:`flor.trust.Forged`)."""
    path = os.fspath(path)
    try:
        return _core.load(path, _location_hook(map_location, path),
                          trust.policy(path, trusted, expect_tag, seen, sealed))
    except _core.FormatError as e:
        raise CheckpointCorrupt(*e.args) from None
    except trust.HookFailed as e:
        raise e.__cause__ from None


def restore(live, saved):
    """Copy the state ``saved`` (from :func:`load` or ``Snapshot.restore()``)
    into the live object ``live`` in place, and return the restored object.

    - an object with ``load_state_dict`` (module, optimizer, scheduler, scaler)
      gets ``live.load_state_dict(saved)``;
    - a tensor gets ``live.copy_(saved)`` (any device; shapes must match);
    - a random generator (torch, numpy, ``random.Random``) gets the saved state;
    - a handle (Accelerate's ``Accelerator``; see flor/handles.py) gets
      back its own plain values and its parts' state, and keeps the rest
      (a handle with no live one to put them on raises ValueError);
    - dicts, lists and sets are updated item by item, in place;
    - a tuple, or anything immutable, cannot change in place: the restored
      value is returned, so rebind it (``x = flor.restore(x, saved)``).
    """
    return _restore(live, saved, "obj", _as_is)


def restore_placed(live, saved, place=None, loaded=None):
    """:func:`restore`, with `place` (if any) applied to each part of
    `saved` that becomes live as it is (a new dict key, a replaced list, a
    value that cannot change in place, a state dict an object may keep)
    rather than being copied into a live object.  `loaded` (a dict), if
    given, receives ``id(state dict): live object`` for each object restored
    through its state dict, to find the live object that another name for
    it (saved as the same state dict) stands for."""
    return _restore(live, saved, "obj", place or _as_is, loaded)


def _as_is(value):
    return value


def _restore(live, saved, where, place, loaded=None):
    if isinstance(saved, Handle):
        return saved.apply(live, where)
    torch = sys.modules.get("torch")
    try:
        load_sd = getattr(live, "load_state_dict", None)
    except Exception:  # noqa: BLE001 -- a __getattr__ that raises other than AttributeError
        load_sd = None
    if callable(load_sd) and isinstance(saved, Mapping) and not isinstance(live, Mapping):
        if loaded is not None:
            loaded[id(saved)] = live
        if place is _as_is:
            load_sd(saved)
        elif torch is not None and isinstance(live, torch.nn.Module):
            # Copied into its parameters and buffers; any other entry (extra
            # state, a metric's state) it may keep as it is handed.
            own = {n for n, _ in live.named_parameters()} | {n for n, _ in live.named_buffers()}
            for key in [k for k in saved if k not in own]:
                saved[key] = place(saved[key])
            load_sd(saved)
        else:
            load_sd(place(saved))
        return live
    np = sys.modules.get("numpy")
    # Random generators: set the live one's state, so whoever holds it
    # (a DataLoader's sampler, a data pipeline) draws the recorded numbers.
    if torch is not None and isinstance(live, torch.Generator) and \
            isinstance(saved, torch.Generator):
        live.set_state(saved.get_state())
        return live
    if np is not None and isinstance(live, np.random.Generator) and \
            isinstance(saved, np.random.Generator):
        live.bit_generator.state = saved.bit_generator.state
        return live
    if np is not None and isinstance(live, np.random.RandomState) and \
            isinstance(saved, np.random.RandomState):
        live.set_state(saved.get_state())
        return live
    if isinstance(live, random.Random) and isinstance(saved, random.Random):
        live.setstate(saved.getstate())
        return live
    if torch is not None and isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        if live.shape != saved.shape:
            raise ValueError(
                f"cannot restore {where}: the live tensor has shape {tuple(live.shape)}, "
                f"the saved one {tuple(saved.shape)}"
            )
        with torch.no_grad():
            live.copy_(saved)
        return live
    if type(live) is dict or (isinstance(live, dict) and isinstance(saved, Mapping)):
        if not isinstance(saved, Mapping):
            return place(saved)
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            live[key] = _restore(live[key], value, f"{where}[{key!r}]", place, loaded) \
                if key in live else _fresh(value, f"{where}[{key!r}]", place)
        return live
    if isinstance(live, list) and isinstance(saved, list):
        if len(live) == len(saved):
            for i, value in enumerate(saved):
                live[i] = _restore(live[i], value, f"{where}[{i}]", place, loaded)
        else:
            live[:] = [_fresh(value, f"{where}[{i}]", place) for i, value in enumerate(saved)]
        return live
    if isinstance(live, set) and isinstance(saved, (set, frozenset)):
        live.clear()
        live.update(place(saved))
        return live
    if isinstance(live, tuple) and isinstance(saved, tuple) and len(live) == len(saved):
        items = [_restore(a, b, f"{where}[{i}]", place, loaded)
                 for i, (a, b) in enumerate(zip(live, saved))]
        if all(a is b for a, b in zip(items, live)):
            return live
        return type(saved)(*items) if hasattr(saved, "_fields") else type(saved)(items)
    if np is not None and isinstance(live, np.ndarray) and isinstance(saved, np.ndarray):
        if live.shape == saved.shape and live.dtype == saved.dtype and live.flags.writeable:
            live[...] = saved
            return live
        return saved
    if (
        _same_class(type(live), type(saved))
        and hasattr(live, "__dict__")
        and not isinstance(live, type)
        and hasattr(saved, "__dict__")
    ):
        _restore(live.__dict__, dict(saved.__dict__), where, place, loaded)
        return live
    return place(saved)


def _fresh(value, where, place):
    """A saved value that becomes live as it is: never a handle's values,
    which need a live handle to go onto."""
    if isinstance(value, Handle):
        raise ValueError(f"cannot restore {where}: the checkpoint holds the values of a "
                         f"{value.kind}, and there is no live one there to put them on")
    return place(value)


def _same_class(a, b) -> bool:
    """The same class, or the same class of the script's __main__ module
    rebuilt by value when the checkpoint was loaded (cloudpickle pickles the
    classes of __main__ by value)."""
    return a is b or (a.__module__ == b.__module__ == "__main__"
                      and a.__qualname__ == b.__qualname__)
