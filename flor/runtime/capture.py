"""Capture of a running script's output and uncaught exception.

While flor runs a script, sys.stdout (and, in a replay worker, sys.stderr)
is an `Output` whose write is a C `Tee` (csrc/capture.c): it passes the text
on to the real stream when it tees, and journals it in the session's
`Journal`, attributed to the statement of the user's program that wrote it.
`Capture` installs them and an excepthook that notes the exception ending
the run; `restore()` puts back exactly what it replaced, and only that.

A replay worker forked from the fork server (flor/replay/forkserver.py)
runs with modules the server imported before any session: what they kept of
sys.stdout or sys.stderr (a logging handler's stream) is a `Relay`, which
writes where the stream goes once `Capture` installs its `Output`, as it
would have had the module been imported under the session.
"""
from __future__ import annotations

import io
import sys

from .. import _core

__all__ = ["Capture", "Output", "Relay", "STREAMS", "relay", "relayed", "unrelay"]

STREAMS = ("stdout", "stderr")  # the journal's stream numbers


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
    """A stream whose writes are journaled and, when `tee` is set, passed on
    to the real stream.  Anything else is delegated to the real stream."""

    def __init__(self, journal, real, stream, tee):
        self._real, self._stream, self._tee = real, stream, tee
        self._teer = _core.Tee(journal, real, STREAMS.index(stream), tee)
        # An instance attribute: print() finds the C write first.
        self.write = self._teer.write
        self.written = False  # stderr: written to since `Capture.stderr_written` asked
        if stream == "stderr":  # (seldom written: a Python call in front is cheap)
            c_write = self._teer.write

            def write(text):
                self.written = True
                return c_write(text)

            self.write = write

    def show(self, on: bool):
        """Pass writes on to the real stream now (when this stream tees)."""
        self._teer.tee = self._tee and on

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


class Relay(io.TextIOBase):
    """sys.stdout or sys.stderr of a process whose session has not begun,
    for what keeps the stream it found: everything goes to `target`, the
    real stream until a `Capture` points it to its `Output`."""

    def __init__(self, real):
        self.real = self.target = real

    def write(self, text):
        return self.target.write(text)

    def writelines(self, lines):
        for line in lines:
            self.target.write(line)

    def flush(self):
        return self.target.flush()

    def fileno(self):
        return self.target.fileno()

    def isatty(self):
        return self.target.isatty()

    def writable(self):
        return True

    @property
    def buffer(self):
        return _RelayBinary(self)

    @property
    def encoding(self):
        return self.target.encoding

    @property
    def errors(self):
        return self.target.errors

    def __getattr__(self, name):
        return getattr(self.target, name)


class _RelayBinary:
    """A relay's buffer: bytes go to its target's buffer as they are
    written (a captured stream's journals them)."""

    def __init__(self, owner):
        self._owner = owner

    def write(self, b):
        return self._owner.target.buffer.write(b)

    def flush(self):
        self._owner.target.flush()

    def __getattr__(self, name):
        return getattr(self._owner.target.buffer, name)


RELAYS: dict[str, Relay] = {}  # stream name -> its relay, in a fork server and its workers


def relay():
    """Make sys.stdout and sys.stderr relays (a fork server, before it imports)."""
    for name in STREAMS:
        RELAYS[name] = Relay(getattr(sys, name))
        setattr(sys, name, RELAYS[name])


def relayed() -> bool:
    """Whether sys.stdout and sys.stderr are still the relays."""
    return all(getattr(sys, name) is r for name, r in RELAYS.items())


def unrelay():
    """Put the real streams back as sys.stdout and sys.stderr (a forked
    worker, as a started one has them); the relays stay with what kept
    them."""
    for name, r in RELAYS.items():
        setattr(sys, name, r.real)


class Capture:
    """Journal sys.stdout (teed when `stdout_tee`) and optionally sys.stderr
    (not teed) into `journal`, and optionally note the uncaught exception in
    `error` (the hook that was installed keeps running)."""

    def __init__(self, journal, stdout_tee: bool, stderr: bool, watch_exceptions: bool):
        self.error: BaseException | None = None
        self.journal = journal
        self.tee = stdout_tee  # the script's output is shown as it runs
        self._installed = {}  # stream name -> (the Output installed, the stream it replaced)
        for name, tee in (("stdout", stdout_tee), ("stderr", False))[:2 if stderr else 1]:
            real = getattr(sys, name)
            out = Output(journal, real, name, tee)
            self._installed[name] = (out, real)
            setattr(sys, name, out)
            if name in RELAYS and RELAYS[name].target is real:
                RELAYS[name].target = out
        self._hook = None
        if watch_exceptions:
            previous = sys.excepthook

            def hook(exc_type, exc, tb):
                self.error = exc
                previous(exc_type, exc, tb)

            self._hook = (hook, previous)
            sys.excepthook = hook

    def emit(self, stream: str, text: str):
        """Output that the script did not write now: shown as the stream
        shows what it writes, journaled without a statement."""
        installed = self._installed.get(stream)
        if installed is None:
            return
        out, real = installed
        if out._teer.tee:
            real.write(text)
        self.journal.add(STREAMS.index(stream), text, False)

    def stderr_written(self) -> bool:
        """Whether the script wrote to the captured stderr since the last
        time this was asked."""
        installed = self._installed.get("stderr")
        if installed is None:
            return False
        out = installed[0]
        written, out.written = out.written, False
        return written

    def show(self, on: bool):
        """Show (when teeing) or hide what the script writes from now on."""
        for out, _ in self._installed.values():
            out.show(on)

    def real_of(self, stream):
        """The stream behind `stream` if it is one this capture installed, else None."""
        for out, real in self._installed.values():
            if stream is out:
                return real
        return None

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
