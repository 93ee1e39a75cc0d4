"""What flor's followers of training libraries share (lightning.py for
PyTorch Lightning, huggingface.py for the Hugging Face Trainer): the
session of this process, the script's frame that started the library's
training, a training as a main loop of epochs (EpochLoop), and the values
an object keeps in its attributes (a callback's history)."""
from __future__ import annotations

import collections
import numbers
import os
import sys

from .context import epoch_key
from .runtime.session import Inert, Session

__all__ = ["session", "Epochs", "EpochLoop", "values", "script_frame"]


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


def values(obj) -> dict:
    """An object's own attributes that hold values: numbers, strings,
    containers (the outputs a ``training_step`` gathers for
    ``on_train_epoch_end``, a defaultdict of histories), tensors, arrays."""
    import torch

    kinds = _PLAIN + (torch.Tensor,)
    np = sys.modules.get("numpy")
    if np is not None:
        kinds += (np.ndarray, np.generic)
    return {k: v for k, v in vars(obj).items()
            if not k.startswith("_") and k != "training" and isinstance(v, kinds)}


def script_frame(s, depth=1):
    """The frame of the script's line that called into the library (else
    the caller's, `depth` frames up)."""
    f = sys._getframe(depth)
    while f is not None:
        if s.script is not None and os.path.abspath(f.f_code.co_filename) == s.script:
            return f
        f = f.f_back
    return sys._getframe(depth)
