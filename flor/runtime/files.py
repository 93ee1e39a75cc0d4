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
  (modes ``w`` and ``x``): it is opened only if the script writes to it
  once they no longer are, for appending (truncated first if the set-up
  opened it with ``w`` and no other part of the replay wrote it yet);
- a file that replay's set-up (before the main loop) opens with ``w`` is
  truncated by the first part only, unless another part wrote to it first
  (workers start together, and parts run by a scheduler in any order: the
  first part of the replay to write a file leaves a mark in the replay's
  directory), and appended to by every part, so that workers writing one
  file side by side never overwrite each other's lines.  Their lines
  follow the order the workers wrote them in, not the iterations'; a file
  rewritten every iteration ends as the part that finished last left it.
- a replay of one segment opens files as the script asks.

Files opened for reading, files that libraries open (torch.save(path),
numpy.save, DataFrame.to_csv), os.open and flor's own files are never
touched.
"""
from __future__ import annotations

import builtins
import hashlib
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


def _key(file) -> str:
    try:
        return os.path.abspath(os.fspath(file))
    except TypeError:
        return repr(file)


class GuardedFile:
    """A file the user's code opened for writing (see the module's docstring):
    opened now (`real`) or at its first write (`pending`: open's arguments)."""

    def __init__(self, effects, real=None, pending=None, opener=None, truncate=False):
        self._fx, self._real, self._pending, self._opener = effects, real, pending, opener
        self._truncate = truncate  # opened with "w" while quiet
        self._closed = False

    def _file(self):
        if self._real is None:
            if self._closed:
                raise ValueError("I/O operation on closed file.")
            file, mode, args, kwargs = self._pending
            # The first part of a replay to write a file its set-up opened
            # with "w" truncates it (what it held predates the replay); the
            # others, and part 0 from then on, append.
            if self._fx.files_first_writer(file) and self._truncate:
                mode = mode.replace("a", "w", 1)
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
        self._truncated = set()  # files this process's set-up truncated
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
            return GuardedFile(fx, pending=(file, appending, args, kwargs), opener=original,
                               truncate="w" in mode)
        if "w" in mode and fx.s.replaying and fx.s.phase == "pre" and \
                len(fx.s.policy.plan.segments) > 1:
            key = _key(file)
            if key in self._truncated or self.first_writer(file):
                original(file, mode, *args, **kwargs).close()  # part 0 truncates, as asked
                self._truncated.add(key)
            mode = mode.replace("w", "a")
        return GuardedFile(fx, original(file, mode, *args, **kwargs))

    def first_writer(self, file) -> bool:
        """Whether this is the first part of the replay to write `file`: the
        first to leave a mark for it in the replay's directory."""
        plan = self.fx.s.policy.plan
        marks = os.path.join(plan.store, "runs", plan.replay_id, "written")
        try:
            os.makedirs(marks, exist_ok=True)
            fd = os.open(os.path.join(marks, hashlib.sha1(_key(file).encode()).hexdigest()),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except (OSError, TypeError, ValueError):
            return True
        os.close(fd)
        return True

    def restore(self):
        if builtins.open is self.replacement:
            builtins.open = self.original
        if io.open is self.replacement:
            io.open = self._io_open
