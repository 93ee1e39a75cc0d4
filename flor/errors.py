"""Every exception flor raises, and the one way flor prints a note."""
from __future__ import annotations

import errno as _errno
import os
import sys

__all__ = ["INTERRUPTIONS", "CheckpointCorrupt", "CheckpointWriteError", "FlorReplayError",
           "FlorError", "StoreError", "SegmentDone", "note", "unusable"]


def note(message: str) -> None:
    """Print ``flor: message`` to the process's real standard error: the
    user's script (or flor itself, in a replay worker) may have replaced
    sys.stderr, and flor's notes are never part of the script's output."""
    say(f"flor: {message}", sys.__stderr__ if sys.__stderr__ is not None else sys.stderr)


def say(text: str, stream=None) -> None:
    """Write `text` and a newline to `stream` (sys.stderr) in one write: a
    print() writes the newline separately, and the lines of processes
    sharing the stream (torchrun's ranks, replay workers) would interleave."""
    stream = stream if stream is not None else sys.stderr
    if stream is None:  # the script set sys.stderr and sys.__stderr__ to None
        try:
            os.write(2, (text + "\n").encode(errors="replace"))
        except OSError:
            pass  # no standard error at all: nowhere to say it
        return
    stream.write(text + "\n")
    stream.flush()


class CheckpointCorrupt(ValueError):
    """A checkpoint file is truncated or damaged.

    ``path`` names the file and ``section`` the damaged part: ``"header"``,
    ``"metadata"``, ``"tensor table"`` or ``"data"``.
    """

    def __init__(self, path: str, section: str, detail: str):
        self.path = path
        self.section = section
        self.detail = detail
        super().__init__(f"{path}: damaged {section}: {detail}")

    def __reduce__(self):
        return (type(self), (self.path, self.section, self.detail))


def _describe(path, err, step, message):
    if err == -1:
        return f"{path}: {message or 'error'} (during {step})"
    name = _errno.errorcode.get(err, str(err))
    return f"{path}: [Errno {err}] {os.strerror(err)} ({name}, during {step})"


def _grouped(failures):
    """One line per error and directory: the first file it failed, and how
    many more (a step loop's every checkpoint can fail alike)."""
    groups = {}
    for path, err, step, message in failures:
        groups.setdefault((os.path.dirname(path), err, step, message), []).append(path)
    for (_, err, step, message), paths in groups.items():
        more = f" (and {len(paths) - 1} more with the same error)" if len(paths) > 1 else ""
        yield _describe(paths[0], err, step, message) + more


class CheckpointWriteError(OSError):
    """One or more checkpoints could not be written.

    ``failures`` lists ``(path, errno, step, message)`` for each; ``errno``
    and ``filename`` describe the first.  An errno of -1 means a Python
    error (for example an object that cannot be pickled); ``message`` says which.
    """

    def __init__(self, failures):
        self.failures = [(os.fsdecode(p), e, s, m) for p, e, s, m in failures]
        first = self.failures[0]
        lines = "\n  ".join(_grouped(self.failures))
        n = len(self.failures)
        super().__init__(
            first[1] if first[1] > 0 else _errno.EIO,
            f"flor could not write {n} checkpoint{'s' if n != 1 else ''}:\n  {lines}",
        )
        self.filename = first[0]

    def __str__(self):
        return self.args[1]


class FlorReplayError(RuntimeError):
    """Replay cannot reproduce the recorded run at this point."""


class FlorError(Exception):
    """A user-facing error of the flor command line: printed as ``flor:
    message``, exit status 2."""


class StoreError(FlorError):
    """The run store cannot be used: its database belongs to another
    program or to a flor of another schema version."""


class SegmentDone(BaseException):
    """Ends a replay worker whose segment of the main loop is done.

    A BaseException, like SystemExit, so that ``except Exception`` in the
    script does not catch it; the code after the main loop then runs only in
    the worker that replays the last iteration."""


class Interrupted(SystemExit):
    """Raised in a recording script by SIGTERM (an eviction notice): the
    script unwinds like after ``sys.exit(143)``, flor writes the checkpoints
    in flight, and the run is left interrupted, to continue with
    ``python -m flor record --resume``."""

    def __init__(self):
        super().__init__(143)


#: What ends a run as interrupted, not failed: SIGTERM, and Ctrl-C.
INTERRUPTIONS = (Interrupted, KeyboardInterrupt)


def unusable(db_file, error) -> StoreError:
    """The StoreError for an OSError or SQLite error met opening or writing
    the store at `db_file`: what is wrong, and the way out."""
    root = os.path.dirname(db_file)
    text = str(error) if _is_sqlite(error) else (error.strerror or str(error))
    if _is_sqlite(error) and any(
            m in text for m in ("not a database", "malformed", "encrypted")):
        return StoreError(f"{db_file} is damaged or is not a database ({text}); flor leaves it "
                          "untouched. Move it away to start a new store there, or point "
                          "FLOR_DIR at another directory")
    if isinstance(error, OSError) and os.path.exists(root) and not os.path.isdir(root):
        return StoreError(f"cannot use {root} as flor's run store: it is a file, not a "
                          "directory. Point FLOR_DIR at a directory")
    return StoreError(f"cannot write flor's run store at {root} ({text}). Make it writable, "
                      "free some space, or point FLOR_DIR at another directory")


def _is_sqlite(error) -> bool:
    return type(error).__module__ == "sqlite3"
