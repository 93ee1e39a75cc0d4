"""What flor's followers of training libraries share (lightning.py for
PyTorch Lightning, huggingface.py for the Hugging Face Trainer): the
session of this process, the script's frame that started the library's
training, the epochs as a main loop's iterable, and the values an object
keeps in its attributes (a callback's history)."""
from __future__ import annotations

import collections
import numbers
import os
import sys

from .runtime.session import Inert, Session

__all__ = ["session", "Epochs", "values", "script_frame"]


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
