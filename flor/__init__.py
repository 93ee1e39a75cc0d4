"""Flor: record-replay for PyTorch training.

Importing flor prints nothing and initialises nothing: torch and CUDA are
touched only when a snapshot or load meets a tensor, and a run starts when a
script first uses flor.generator, flor.SkipBlock, flor.log or flor.label.
"""
from ._core import Snapshot, snapshot
from .api import SkipBlock, dataframe, dataframes, generator, label, log, names
from .checkpoint import load, restore, save
from .errors import CheckpointCorrupt, CheckpointWriteError, FlorReplayError
from .materializer import Materializer
from .recorded import RecordedState, state, state_iterations
from .trust import UnsafeCheckpoint
from .version import __version__


__all__ = [
    "CheckpointCorrupt",
    "CheckpointWriteError",
    "FlorReplayError",
    "Materializer",
    "RecordedState",
    "SkipBlock",
    "Snapshot",
    "UnsafeCheckpoint",
    "__version__",
    "dataframe",
    "dataframes",
    "generator",
    "label",
    "load",
    "log",
    "names",
    "restore",
    "save",
    "snapshot",
    "state",
    "state_iterations",
]
