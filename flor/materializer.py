"""flor.Materializer: snapshot now, write in the background.

The engine (buffering, the writer thread, fork and reaping, backpressure) is
C, in csrc/materializer.c.  This wrapper names files, validates arguments,
turns raw failures into CheckpointWriteError, and flushes at exit.
"""
from __future__ import annotations

import atexit
import os
import re
import threading

from . import _core, trust
from .errors import CheckpointWriteError, note

__all__ = ["Materializer", "DEFAULT_MODE", "MODES", "mode_from_env"]

MODES = {"inline": 0, "thread": 1, "fork": 2}

#: Chosen by benchmarks/materialize.py; docs/checkpoints.md ("Choosing the default
#: materializer mode") gives the figures.
DEFAULT_MODE = "thread"

DEFAULT_MAX_BUFFER_BYTES = 1 << 30
ENV_MODE = "FLOR_MATERIALIZER"
SUFFIX = ".flor"
_TMP = re.compile(r"^(?P<final>.+)\.tmp\.(?P<pid>\d+)\.\d+$")

# Open materializers, closed (and so flushed) at exit even if dropped unclosed.
_live: "set[Materializer]" = set()


def _check_name(name):
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint name must be a non-empty string, not {name!r}")
    if "/" in name or "\0" in name or (os.altsep and os.altsep in name) or name in (".", ".."):
        raise ValueError(
            f"checkpoint name {name!r} must be a plain file name (no '/', no NUL), "
            "for example 'epoch-3'"
        )
    if name.startswith("."):
        raise ValueError(f"checkpoint name {name!r} must not start with '.' (reserved for temp files)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temp_files(directory) -> list:
    """Remove temp files left by writers that were killed mid-write (their
    process is gone).  A temp file never holds a completed checkpoint: that
    one was renamed to its final name.  Returns the removed paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if m and m["final"].endswith(SUFFIX) and not _pid_alive(int(m["pid"])):
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def mode_from_env() -> str:
    """The mode that a record uses: ``FLOR_MATERIALIZER``, else the default."""
    mode = os.environ.get(ENV_MODE, DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE} must be thread, fork or inline, not {mode!r}")
    return mode


class Materializer:
    """Writes snapshots of objects to ``directory`` without blocking training.

    ``submit(name, obj)`` copies ``obj`` at memory speed (tensors into warm
    staging buffers, containers rebuilt; CUDA tensors on a copy stream of
    flor's own, which the writer waits for: flor/_cuda.py) and returns; the file
    ``directory/name.flor`` is written later.  ``flush()`` returns once every
    submitted checkpoint is durable and raises :class:`CheckpointWriteError`
    if any write failed.  Use it as a context manager, or call ``close()``;
    an exit hook flushes materializers still open when Python exits.

    Modes:

    - ``"thread"`` (default): a C writer thread writes while training goes on.
      It takes the GIL only to pickle the snapshot's small Python skeleton.
    - ``"fork"``: snapshots are batched; when the batch passes ``batch_bytes``
      or ``batch_count`` the process forks and the child pickles and writes
      the batch, then exits.  At most ``max_children`` children live at once.
    - ``"inline"``: writes during ``submit``; the baseline.

    ``max_buffer_bytes`` bounds the staging memory of the snapshots not yet
    written (the arenas they hold: whole 2 MiB huge pages, or 64 KiB steps
    under 1 MiB); ``submit`` waits when a new snapshot would pass it
    (backpressure).  One snapshot larger than the bound is let through alone.

    ``incremental=True`` (thread and inline modes) makes a checkpoint refer to
    the tensor bytes that an earlier file of this materializer already holds
    instead of writing them again (docs/FORMAT.md): such a file needs the
    earlier files next to it.  ``signed=True`` signs each file with the user's
    key (:mod:`flor.trust`), so that flor's replay may unpickle it in full.
    """

    def __init__(
        self,
        directory,
        mode: str = DEFAULT_MODE,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        max_children: int = 2,
        batch_bytes: int | None = None,
        batch_count: int = 5000,
        incremental: bool = False,
        signed: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}")
        if max_buffer_bytes <= 0:
            raise ValueError(f"max_buffer_bytes must be positive, not {max_buffer_bytes}")
        if not 1 <= max_children <= 64:
            raise ValueError(f"max_children must be between 1 and 64, not {max_children}")
        if batch_count < 1:
            raise ValueError(f"batch_count must be at least 1, not {batch_count}")
        if batch_bytes is None:
            batch_bytes = max(1, max_buffer_bytes // (max_children + 1))
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot create the checkpoint directory: {e.strerror}", self.directory
            ) from None
        if not os.path.isdir(self.directory):
            raise NotADirectoryError(
                f"checkpoint directory {self.directory!r} exists and is not a directory"
            )
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(
                f"checkpoint directory {self.directory!r} is not writable by this process; "
                "choose another directory or fix its permissions"
            )
        sweep_temp_files(self.directory)
        self.mode = mode
        self._engine = _core.Materializer(
            MODES[mode], max_buffer_bytes, max_children, batch_bytes, batch_count,
            incremental, trust.signer(strict=False) if signed else None
        )
        # One caller at a time: the engine's fork bookkeeping is not shared.
        self._lock = threading.Lock()
        # Incremental files refer to earlier ones: a name written twice would
        # replace bytes that later files refer to.
        self._names = set() if incremental and mode != "fork" else None
        _live.add(self)

    def path_for(self, name: str) -> str:
        _check_name(name)
        return os.path.join(self.directory, name + SUFFIX)

    def submit(self, name: str, obj, tag: bytes | None = None) -> int:
        """Snapshot ``obj`` now; write it to ``directory/name.flor`` later,
        with ``tag`` (32 bytes, see :func:`flor.trust.tag_of`) in its header.
        Returns the bytes of tensor and array data the file will hold (with
        ``incremental``, those no earlier file holds)."""
        path = self.path_for(name)
        with self._lock:
            if self._names is not None:
                if name in self._names:
                    raise ValueError(
                        f"checkpoint {name!r} was written already: with incremental=True, later "
                        "checkpoints may refer to its bytes, so a name cannot be written twice. "
                        "Give each checkpoint its own name, or use incremental=False for a file "
                        "that is replaced each time")
                self._names.add(name)
            return self._engine.submit(path, obj, tag)

    def flush(self) -> None:
        """Block until every submitted checkpoint is durable on disk.

        Raises :class:`CheckpointWriteError` naming each failed file, its
        errno and the step that failed (for example ENOSPC during write)."""
        with self._lock:
            failures = self._engine.flush()
        if failures:
            raise CheckpointWriteError(failures)

    def close(self) -> None:
        """Flush, stop the writer, and raise if any write failed."""
        with self._lock:
            failures = self._engine.close()
        _live.discard(self)
        if failures:
            raise CheckpointWriteError(failures)

    def remove(self, name: str) -> bool:
        """Delete the durable checkpoint ``directory/name.flor`` unless a
        checkpoint of this materializer refers to its bytes (incremental);
        either way, later checkpoints refer to them only if one already did.
        Returns whether the file was deleted (True too for a file that is
        not there).  If deleting it fails (OSError), it is out of the index
        anyway and no longer keeps the files it refers to: treat it as gone.
        Call it only for a checkpoint written already (after its submit's
        write finished, or ``flush``): the file of one still being written
        is not the materializer's to delete."""
        path = self.path_for(name)
        with self._lock:
            if not self._engine.retire(os.path.basename(path)):
                return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # its write failed
        return True

    def stats(self) -> dict:
        """Counters: submitted, written, failed, bytes_written, write_seconds
        (written, failed and their seconds counted as each write finishes),
        block_seconds, max_block_seconds, forks, held_bytes, pending (not yet
        durable), writing (being written now), writer_cpu_seconds (the CPU
        time the writers used: the writer thread's as it runs, a fork
        child's once it is reaped)."""
        return self._engine.stats()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except CheckpointWriteError as e:
                exc.add_note(str(e))

    def __repr__(self):
        return f"<flor.Materializer mode={self.mode!r} directory={self.directory!r}>"


@atexit.register
def _close_all():
    for m in list(_live):
        try:
            m.close()
        except RuntimeError:
            pass  # a forked copy of the process: the parent owns these writes
        except Exception as e:  # report, and still close the others
            note(f"at exit: {e}")
