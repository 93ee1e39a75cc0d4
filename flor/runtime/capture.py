"""Capture of a running script's output and uncaught exception.

While flor runs a script, sys.stdout (and, in a replay worker, sys.stderr)
is an `Output` that hands every write to a sink, and passes it on to the
real stream when it tees.  `Capture` installs them and an excepthook that
notes the exception ending the run; `restore()` puts back exactly what it
replaced, and only that.
"""
from __future__ import annotations

import io
import sys

__all__ = ["Capture", "Output"]


class _Binary:
    """sys.stdout.buffer of an Output: bytes are captured like text."""

    def __init__(self, owner):
        self._owner = owner

    def write(self, b):
        self._owner.write(bytes(b).decode(self._owner.encoding, "replace"))
        return len(b)

    def flush(self):
        self._owner.flush()

    def __getattr__(self, name):
        return getattr(self._owner._real.buffer, name)


class Output(io.TextIOBase):
    """A stream whose writes go to `sink(stream, text)` and, when `tee` is
    set, to the real stream.  Anything else is delegated to the real stream."""

    def __init__(self, sink, real, stream, tee):
        self._sink, self._real, self._stream, self._tee = sink, real, stream, tee

    def write(self, s):
        if self._tee:
            self._real.write(s)
        self._sink(self._stream, s)
        return len(s)

    def flush(self):
        self._real.flush()

    def writable(self):
        return True

    def isatty(self):
        return self._tee and self._real.isatty()

    def fileno(self):
        return self._real.fileno()

    @property
    def buffer(self):
        return _Binary(self)

    @property
    def encoding(self):
        return getattr(self._real, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self._real, "errors", "strict")

    def __getattr__(self, name):
        return getattr(self._real, name)


class Capture:
    """Route sys.stdout (teed) and optionally sys.stderr (not teed) through
    `sink`, and optionally note the uncaught exception in `error` (the hook
    that was installed keeps running)."""

    def __init__(self, sink, stdout_tee: bool, stderr: bool, watch_exceptions: bool):
        self.error: BaseException | None = None
        self._installed = {}  # stream name -> (the Output installed, the stream it replaced)
        for name, tee in (("stdout", stdout_tee), ("stderr", False))[:2 if stderr else 1]:
            real = getattr(sys, name)
            out = Output(sink, real, name, tee)
            self._installed[name] = (out, real)
            setattr(sys, name, out)
        self._hook = None
        if watch_exceptions:
            previous = sys.excepthook

            def hook(exc_type, exc, tb):
                self.error = exc
                previous(exc_type, exc, tb)

            self._hook = (hook, previous)
            sys.excepthook = hook

    def restore(self):
        """Put back each stream and the excepthook this capture replaced, if
        they are still the ones it installed."""
        for name, (out, real) in self._installed.items():
            if getattr(sys, name) is out:
                out.flush()
                setattr(sys, name, real)
        self._installed = {}
        if self._hook is not None and sys.excepthook is self._hook[0]:
            sys.excepthook = self._hook[1]
        self._hook = None
