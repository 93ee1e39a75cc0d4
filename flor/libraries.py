"""What flor's followers of training libraries share (lightning.py for
PyTorch Lightning, huggingface.py for the Hugging Face Trainer): the
session of this process, the script's frame that started the library's
training, a training as a main loop of epochs (EpochLoop), and the values
an object keeps in its attributes (a callback's history)."""
from __future__ import annotations

import ast
import collections
import copy
import json
import numbers
import os
import sys

from . import _core
from .context import STATE_ENTRY, epoch_key
from .errors import note
from .program.analysis import globals_changed
from .runtime.blockstate import random_fingerprint
from .runtime.session import Inert, Session

__all__ = ["session", "Epochs", "EpochLoop", "values", "set_values", "script_frame"]


def session():
    """The flor session of this process, if one is recording or replaying
    (never starts one)."""
    s = Session._current
    if s is None or isinstance(s, Inert) or s.pid != os.getpid():
        return None
    return s


class Epochs:
    """A main loop's iterable: epoch numbers until the library's training
    ends (`done`)."""

    def __init__(self):
        self.n, self.done = 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise StopIteration
        self.n += 1
        return self.n - 1


class EpochLoop:
    """One training of a library: its epochs as flor's main loop (keyed by
    the script's line that started it, `frame`'s), each epoch's training
    the block in it; `carrier` (runtime/carry.py) says what an iteration
    checkpoint holds.  A follower drives it from the library's hooks."""

    def __init__(self, s, frame, carrier):
        self.s, self.frame = s, frame
        self.epochs = Epochs()
        self.where = s.site(frame, structural=True)
        self.block = epoch_key(self.where)
        self.loop = s.loop(self.epochs, self.where, frame, carrier)
        self.epoch = None  # the iteration flor is in
        self.resumed_at = None  # a replay segment's first epoch, restored
        self.in_block = False
        self.diverged_at = None  # replay: the first epoch whose random state differed
        self.globals = _changed_globals(s.script, frame)

    def step_into(self) -> bool:
        """Enter the epoch's block: whether its training runs.  The random
        state it starts with is stored (the checks compare it); a replay
        runs the training of an epoch whose random state differs from the
        record's (a change before it drew random numbers: a probe that runs
        the model in training mode, with dropout), since its checkpoint
        holds the record's training, not what a plain run of the edited
        script trains.  Not at a replay segment's first epoch: the library
        resumes from the restored iteration checkpoint in its own order, and
        no change of the script ran since."""
        s = self.s
        if self.epoch == self.resumed_at:
            return s.step_into(self.block, False, self.frame)
        # One CRC of the global random states' (a fingerprint, as the checks
        # compare them).
        fp = _core.crc32c(json.dumps(random_fingerprint(), sort_keys=True).encode())
        if not s.discard:
            s.logbook.value(STATE_ENTRY, fp, self.where)
        recorded = s.policy.recorded_value(STATE_ENTRY, self.where, s.where.ctx)
        differs = recorded is not None and recorded != fp
        if differs and self.diverged_at is None:
            self.diverged_at = self.epoch
            note(f"the random state at the start of epoch {self.epoch} of the training at "
                 f"{self.where} differs from the record's (a change before it draws random "
                 "numbers): its training, and that of the epochs after it, runs again")
        return s.step_into(self.block, differs, self.frame)

    def held_globals(self) -> dict:
        """The values of the script's module-level names that the code the
        library calls changes (`globals_changed`): a counter or a history
        itself, and the attributes of an object or a class of the script
        (``NS.examples += n``, ``Counter.calls += 1``)."""
        g = self.frame.f_globals
        named = {k: g[k] for k in sorted(self.globals) if k in g}
        plain = values(named, own=True)
        objects = {k: _held(v, self.s) for k, v in named.items()
                   if k not in plain and _own_object(v, self.s)}
        # A copy: what a checkpoint's digest covers shares nothing with the
        # other objects it holds (a global tensor that is also a module's
        # buffer), as what a restore reads back shares nothing either.
        return copy.deepcopy({"values": plain, "objects": objects})

    def put_back_globals(self, saved):
        """A tensor goes back in place (a module may hold it as a buffer
        too), a container is refilled, an object's attributes are set."""
        import torch

        g = self.frame.f_globals
        rest = {}
        for k, v in saved["values"].items():
            live = g.get(k)
            if isinstance(live, torch.Tensor) and isinstance(v, torch.Tensor) and \
                    live.shape == v.shape and live.dtype == v.dtype:
                with torch.no_grad():
                    live.copy_(v)
            else:
                rest[k] = v
        set_values(g, rest)
        for k, held in saved["objects"].items():
            if k in g:
                _put_held(g[k], held)

    def next(self):
        """The next iteration of the main loop (the one before it ends), or
        None when the loop has ended."""
        try:
            return next(self.loop)
        except StopIteration:
            return None

    def end(self):
        """The training ended: the last iteration ends, and the main loop
        with it."""
        self.leave_block()
        self.epochs.done = True
        while self.next() is not None:
            pass

    def abandon(self):
        """The training raised: the block and the loop end without
        checkpoints."""
        self.leave_block()
        self.loop.close()

    def leave_block(self):
        if self.in_block:
            self.in_block = False
            self.left()
            self.s.abandon()

    def left(self):
        """A block is left without its end (the training ended or raised)."""


_PLAIN = (list, dict, tuple, set, collections.deque, numbers.Number, str, bytes, type(None))


def values(obj, own=False) -> dict:
    """An object's own attributes that hold values: numbers, strings,
    containers (the outputs a ``training_step`` gathers for
    ``on_train_epoch_end``, a defaultdict of histories), tensors, arrays.
    `own`: an object of the script's own class, whose private attributes
    (``self._updates``) and modules (an EMA copy of the model) count too."""
    import torch

    kinds = _PLAIN + (torch.Tensor,) + ((torch.nn.Module,) if own else ())
    np = sys.modules.get("numpy")
    if np is not None:
        kinds += (np.ndarray, np.generic)
    items = obj if isinstance(obj, dict) else vars(obj)
    return {k: v for k, v in items.items()
            if (own or not k.startswith("_")) and k != "training" and isinstance(v, kinds)}


def set_values(obj, saved):
    """Put back what `values` took: a module loaded in place (a checkpoint
    holds its state dict), a list, dict, set or deque refilled in place
    (the script may hold it under another name too: a callback's history
    the script prints), anything else set.  `obj` may be a namespace (a
    module's globals)."""
    import torch

    live_values = obj if isinstance(obj, dict) else vars(obj)
    for k, v in saved.items():
        live = live_values.get(k)
        if isinstance(live, torch.nn.Module) and isinstance(v, (dict, torch.nn.Module)):
            live.load_state_dict(v.state_dict() if isinstance(v, torch.nn.Module) else v)
        elif isinstance(live, list) and isinstance(v, list):
            live[:] = v
        elif isinstance(live, dict) and isinstance(v, dict):
            live.clear()
            live.update(v)
        elif isinstance(live, (set, collections.deque)) and type(v) is type(live):
            live.clear()
            live.update(v) if isinstance(live, set) else live.extend(v)
        elif isinstance(obj, dict):
            obj[k] = v
        else:
            setattr(obj, k, v)


def _own_object(obj, s) -> bool:
    """A namespace object, or a class of the script's (or of a module of the
    project that hands-free mode instrumented), or an instance of one: its
    attributes are the script's values.  Not a library's object (a logger,
    a SummaryWriter: what they hold is no training state, and cannot be
    copied)."""
    import types

    if isinstance(obj, types.SimpleNamespace):
        return True
    cls = obj if isinstance(obj, type) else type(obj)
    mod = sys.modules.get(cls.__module__)
    path = getattr(mod, "__file__", None)
    return mod is not None and (cls.__module__ == "__main__" or (
        path is not None and os.path.abspath(path) in s.project_files))


def _held(obj, s, depth=0) -> dict:
    """The values of an object of the script's (`_own_object`), and those
    of the objects of the script's that it holds (``CFG.sub.n``)."""
    attrs = {k: v for k, v in vars(obj).items() if not (k.startswith("__") and k.endswith("__"))}
    plain = values(attrs, own=True)
    inner = {k: _held(v, s, depth + 1) for k, v in attrs.items()
             if k not in plain and depth < 4 and not isinstance(v, type) and _own_object(v, s)}
    return {"values": plain, "objects": inner}


def _put_held(obj, held):
    set_values(obj, held["values"])
    for k, inner in held["objects"].items():
        live = getattr(obj, k, None)
        if live is not None:
            _put_held(live, inner)


def _changed_globals(script, frame) -> set:
    """The script's module-level names its functions change (a counter a
    compute_loss increments), when `frame` runs in the script."""
    if script is None or os.path.abspath(frame.f_code.co_filename) != script:
        return set()
    try:
        with open(script) as f:
            return globals_changed(ast.parse(f.read()))
    except (OSError, SyntaxError, ValueError):
        return set()


def script_frame(s, depth=1):
    """The frame of the script's line that called into the library (else
    the caller's, `depth` frames up)."""
    f = sys._getframe(depth)
    while f is not None:
        if s.script is not None and os.path.abspath(f.f_code.co_filename) == s.script:
            return f
        f = f.f_back
    return sys._getframe(depth)
