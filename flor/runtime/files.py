"""Files the script writes, in a replay worker (and in record --resume):
written once however many workers replay the script.

The rule: a file that the user's program opens for writing with ``open()``
(builtins.open or io.open, also through ``pathlib.Path.open`` and
``write_text``, and the file of a ``logging.FileHandler`` it makes; the
statement calling it is in a file of the program: not flor, not an
installed library) is a `GuardedFile`:

- while the session suppresses side effects (effects.py: pseudoresumed
  iterations, the set-up before the main loop in parts other than the
  first, record --resume before its restore), writes to it do nothing;
- a file opened while they are suppressed is neither created nor truncated
  (modes ``w`` and ``x``): it is opened for appending only if the script
  writes to it once they no longer are;
- a file that replay's set-up (before the main loop) opens with ``w`` is
  truncated by the first part only (unless another part wrote to it since
  the replay began: workers start together, and the first may reach its
  set-up last), and appended to by every part, so that workers writing one
  file side by side never overwrite each other's lines (their lines
  interleave; no line is lost or written twice).

Files opened for reading, files that libraries open (torch.save(path),
numpy.save, DataFrame.to_csv), os.open and flor's own files are never
touched.
"""
from __future__ import annotations

import builtins
import io
import os
import pathlib
import sys

__all__ = ["Files", "GuardedFile"]

_WRITING = frozenset("wax+")
_STDLIB = os.path.dirname(pathlib.__file__)
# Code between the user's statement and open(): pathlib, logging's file
# handlers, and the logging patch of effects.py (a handler that opens its
# file at the first record).
_THROUGH = frozenset({pathlib.__file__, os.path.join(_STDLIB, "logging", "__init__.py"),
                      os.path.join(_STDLIB, "logging", "handlers.py"),
                      os.path.join(os.path.dirname(os.path.abspath(__file__)), "effects.py")})


class GuardedFile:
    """A file the user's code opened for writing (see the module's docstring):
    opened now (`real`) or at its first write (`pending`: open's arguments)."""

    def __init__(self, effects, real=None, pending=None, opener=None):
        self._fx, self._real, self._pending, self._opener = effects, real, pending, opener
        self._closed = False

    def _file(self):
        if self._real is None:
            if self._closed:
                raise ValueError("I/O operation on closed file.")
            file, mode, args, kwargs = self._pending
            self._real = self._opener(file, mode, *args, **kwargs)
        return self._real

    def write(self, data):
        if self._fx.quiet():
            if self.closed:
                raise ValueError("I/O operation on closed file.")
            return len(data)
        return self._file().write(data)

    def writelines(self, lines):
        if self._fx.quiet():
            if self.closed:
                raise ValueError("I/O operation on closed file.")
            return None
        return self._file().writelines(lines)

    def flush(self):
        if self._real is not None:
            self._real.flush()

    def close(self):
        self._closed = True
        if self._real is not None:
            self._real.close()

    @property
    def closed(self):
        return self._real.closed if self._real is not None else self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return iter(self._file())

    def __next__(self):
        return next(self._file())

    def __repr__(self):
        return f"<flor guarded {self._real!r}>" if self._real is not None else \
            f"<flor guarded file {self._pending[0]!r}, not opened yet>"

    def __getattr__(self, name):
        return getattr(self._file(), name)


class Files:
    """builtins.open and io.open, guarded while the session runs."""

    def __init__(self, effects):
        self.fx = effects
        self.original = original = builtins.open
        self._io_open = io.open
        self._started = None  # when the replay began
        guard = self

        def open(file, mode="r", *args, **kwargs):
            if not (_WRITING & set(mode)) or not guard.by_user(sys._getframe(1)):
                return original(file, mode, *args, **kwargs)
            return guard.open(file, mode, args, kwargs)

        self.replacement = open
        builtins.open = io.open = open

    def by_user(self, frame) -> bool:
        """Whether open() was called by the user's program (maybe through
        pathlib or a logging.FileHandler)."""
        if not self.fx._mine():
            return False
        while frame is not None and frame.f_code.co_filename in _THROUGH:
            frame = frame.f_back
        return frame is not None and self.fx.user_code(frame.f_code)

    def open(self, file, mode, args, kwargs):
        fx, original = self.fx, self.original
        if isinstance(file, int):  # a descriptor: guard its writes only
            return GuardedFile(fx, original(file, mode, *args, **kwargs))
        creates = "w" in mode or "x" in mode
        if creates and fx.quiet():
            appending = mode.replace("w", "a").replace("x", "a")
            return GuardedFile(fx, pending=(file, appending, args, kwargs), opener=original)
        if "w" in mode and fx.s.replaying and fx.s.phase == "pre":
            if not self._written_since_start(file):
                original(file, mode, *args, **kwargs).close()  # part 0 truncates, as asked
            mode = mode.replace("w", "a")
        return GuardedFile(fx, original(file, mode, *args, **kwargs))

    def _written_since_start(self, file) -> bool:
        """Whether another part wrote `file` after the replay began (its
        workers start together: part 0 may reach its set-up last)."""
        if self._started is None:
            s = self.fx.s
            run = s.policy.recorded.run(s.run_id)  # the replay's store (a worker's is its own)
            self._started = run["started"] if run is not None else float("inf")
        try:
            return os.path.getmtime(file) >= self._started
        except (OSError, TypeError, ValueError):
            return False

    def restore(self):
        if builtins.open is self.replacement:
            builtins.open = self.original
        if io.open is self.replacement:
            io.open = self._io_open
