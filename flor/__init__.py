"""Flor: record-replay for PyTorch training.

Importing flor prints nothing and initialises nothing: torch and CUDA are
touched only when a snapshot or load meets a tensor.
"""
from ._core import Snapshot, snapshot
from .checkpoint import load, restore, save
from .errors import CheckpointCorrupt, CheckpointWriteError
from .materializer import Materializer

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorrupt",
    "CheckpointWriteError",
    "Materializer",
    "Snapshot",
    "load",
    "restore",
    "save",
    "snapshot",
]
