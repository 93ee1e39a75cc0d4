"""Tensors a script keeps that share memory with a module's parameters or
buffers, put back sharing the live ones.

``best = model.state_dict()`` (no copy), ``snaps.append(model.weight.data)``
or ``w = model.weight.data`` keep tensors that follow the model as it
trains.  A checkpoint holds such a tensor and the module's parameter as one
blob, so the two load sharing memory; but a module is restored by copying
its state dict into the live module (parameters no module in scope holds,
into the live parameters), while the name that keeps the tensor
is rebound to the loaded one, which then no longer follows the live
parameter.  `realias` puts each such tensor back as the same view of the
live parameter's memory, as the record had it.

    pairs = {storage of a loaded tensor copied into a live one: (it, the
             live tensor)}     # a module's state dict, a list of parameters
    for every tensor x the restored objects hold (containers and plain
            objects' attributes, a few levels deep; not a module's own):
        if storage(x) in pairs: x = the same view of the live tensor
"""
from __future__ import annotations

import sys

__all__ = ["realias"]

_DEPTH = 4  # how deep into the restored objects tensors are looked for


def realias(items, loaded: dict, out: list) -> list:
    """`out` (the restored objects of a checkpoint; `items`: (live, saved)
    of those restored in place; `loaded`: id(saved state dict) -> the live
    object restored from it) with every tensor that shares the memory of a
    loaded tensor copied into a live one replaced, in place where a
    container holds it, by the same view of the live tensor.  Returns
    `out`."""
    torch = sys.modules.get("torch")
    if torch is None:
        return out
    pairs = _pairs(torch, items, loaded)
    if not pairs:
        return out
    seen: set = set()

    def fix(x, depth):
        if isinstance(x, torch.Tensor):
            return _live_view(torch, x, pairs)
        if depth > _DEPTH or id(x) in seen or isinstance(
                x, (torch.nn.Module, torch.optim.Optimizer, str, bytes, int, float)):
            return x
        seen.add(id(x))
        if isinstance(x, dict) and _may_hold_tensors(x):
            for k, v in list(x.items()):
                new = fix(v, depth + 1)
                if new is not v:
                    x[k] = new
        elif isinstance(x, list) and _may_hold_tensors(x):
            for i, v in enumerate(x):
                new = fix(v, depth + 1)
                if new is not v:
                    x[i] = new
        elif type(x) is tuple and _may_hold_tensors(x):
            items = [fix(v, depth + 1) for v in x]
            if any(a is not b for a, b in zip(items, x)):
                return tuple(items)
        elif hasattr(x, "__dict__") and not isinstance(x, type) and not _loads_state(x):
            for k, v in list(vars(x).items()):
                new = fix(v, depth + 1)
                if new is not v:
                    try:
                        setattr(x, k, new)
                    except Exception:  # noqa: BLE001 -- a read-only attribute keeps its value
                        pass
        return x

    return [fix(o, 0) for o in out]


def _may_hold_tensors(x, depth=2) -> bool:
    """Whether a container is worth a look: its first or last item (value)
    is a tensor or may hold one, judged as deep as `depth` (a list of a
    million floats, or of small dicts of numbers, appended to at every
    step, is passed over at every restore)."""
    if isinstance(x, (int, float, str, bytes, bool, type(None))):
        return False
    if not isinstance(x, (list, tuple, dict)):
        return True  # a tensor, or an object that may hold one
    if not x:
        return False
    if depth == 0:
        return True
    items = x.values() if isinstance(x, dict) else x
    ends = (next(iter(items)), next(reversed(items)))
    return any(_may_hold_tensors(v, depth - 1) for v in ends)


def _loads_state(x) -> bool:
    try:
        return callable(getattr(x, "load_state_dict", None))
    except Exception:  # noqa: BLE001 -- a __getattr__ that raises other than AttributeError
        return True  # (left alone)


def _pairs(torch, items, loaded) -> dict:
    """{storage pointer: (saved tensor, live tensor)} of the tensors that
    `items` ((live, saved) restored in place) copied into live ones: a
    module's, through its state dict (`loaded`), at any depth, and a tensor
    restored into a live tensor (a list of parameters)."""
    pairs: dict = {}
    seen: set = set()

    def add(saved, live):
        # (not a loaded tensor a container was refilled with: it is no copy)
        ptr, size = _storage(saved)
        if size > 0 and _storage(live)[0] != ptr:
            pairs.setdefault(ptr, (saved, live))

    def walk(live, saved, depth):
        if isinstance(saved, torch.Tensor):
            if isinstance(live, torch.Tensor):
                add(saved, live)
            return
        if depth > _DEPTH or id(saved) in seen:
            return
        seen.add(id(saved))
        module = loaded.get(id(saved))
        if isinstance(module, torch.nn.Module) and isinstance(saved, dict):
            own = module.state_dict(keep_vars=True)
            for k, t in saved.items():
                if isinstance(t, torch.Tensor) and isinstance(own.get(k), torch.Tensor):
                    add(t, own[k])
        elif not _may_hold_tensors(saved):
            return  # (also what is not a container)
        elif isinstance(saved, dict):
            for k, v in saved.items():
                walk(live.get(k) if isinstance(live, dict) else None, v, depth + 1)
        elif isinstance(saved, (list, tuple)):
            same = isinstance(live, (list, tuple)) and len(live) == len(saved)
            for i, v in enumerate(saved):
                walk(live[i] if same else None, v, depth + 1)

    for live, saved in items:
        walk(live, saved, 0)
    return pairs


def _live_view(torch, x, pairs):
    """`x`, or where it shares a loaded module tensor's memory, the same view
    of the live tensor's (the live parameter itself where `x` was it)."""
    ptr, size = _storage(x)
    hit = pairs.get(ptr) if size > 0 else None
    if hit is None:
        return x
    saved, live = hit
    if x.dtype != live.dtype or x.device != saved.device:
        return x
    same = x.size() == saved.size() and x.stride() == saved.stride() and \
        x.storage_offset() == saved.storage_offset()
    if same and isinstance(x, torch.nn.Parameter):
        return live  # the parameter itself
    base = live.detach()
    if same:
        return base
    offset = live.storage_offset() + x.storage_offset() - saved.storage_offset()
    end = offset + 1 + sum((n - 1) * st for n, st in zip(x.size(), x.stride()))
    if offset < 0 or (x.numel() > 0 and end * live.element_size() > _storage(live)[1]):
        return x  # (the live tensor's memory is laid out otherwise: a copy, as before)
    return base.as_strided(x.size(), x.stride(), offset)


def _storage(t) -> tuple:
    """(pointer, bytes) of a tensor's storage; (None, 0) for one without
    (sparse, nested)."""
    if t.layout != sys.modules["torch"].strided or t.is_nested:
        return None, 0  # (torch would raise, from C++, if asked)
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return None, 0
