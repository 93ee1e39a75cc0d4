"""What the script writes besides its output: TensorBoard events, logging
records, progress bars and files (files.py).  Replay must not write them
twice, and the values among them are stored like ``flor.log`` values.

Suppressed: while a session discards what the script does (the
pseudoresumed iterations of a replay worker, record --resume before its
main loop is restored) and before the main loop of every replay part but
the first (each part runs the script's set-up; part 0's counts, as for
output), nothing the script writes to these sinks happens:

- TensorBoard: ``torch.utils.tensorboard.FileWriter.add_event`` drops the
  event.  Every ``SummaryWriter.add_*`` (add_scalar, add_scalars' writer per
  tag, add_histogram, add_image, add_text, add_graph, add_hparams' writer
  ...) ends there, so one patch catches them all, on writers made before
  and after it; the events that only describe the file (file_version,
  session_log) are kept.  ``add_embedding`` writes files of its own: it is
  skipped.
- logging: ``Logger.callHandlers`` does nothing, so no handler sees the
  record, wherever it is attached (a filter on the root logger would miss
  records of loggers that do not propagate, handlers' filters the handlers
  added later).
- progress bars: a tqdm bar writes nothing (see below).
- files: files.py.

Written again: what a block wrote to the script's files in the record, where
replay restores the block from its checkpoint (filewrites.py journals it).

Stored (in iterations that count, record and replay), with the location of
the statement of the user's program that wrote them:

- ``SummaryWriter.add_scalar(tag, v)``: ``tb:<tag>``, a float;
  ``add_scalars(main, {tag: v})``: ``tb:<main>/<tag>``.
- a logging record that reaches the handlers and was made by the user's
  code (its pathname is a file of the program): ``log:<logger name>``, the
  message (``record.getMessage()``: without the handlers' format, which
  holds the time).

Progress bars: a tqdm bar made to write to the captured stdout or stderr
(tqdm's default) writes to the stream behind the capture instead, so its
frames are never journaled: live where the session shows the script's
output (record, ``replay --part``), nowhere in a local replay worker (whose
output is shown only at the end; the replay's own progress line stands in).

Training libraries whose loops flor follows by wrapping their methods
(the Hugging Face Trainer: flor/huggingface.py) register with `follower`
and are patched the same way.

Modules are patched only once the script imports them: those already
imported when the session starts, the others by an import hook, so flor
itself imports neither tensorboard nor tqdm.  `restore()` puts back every
attribute it replaced (while it is still the one it installed), and the
import hook.
"""
from __future__ import annotations

import functools
import os
import sys
import threading

from ..context import LOG, PRE, TB

__all__ = ["Effects", "follower"]

_WRITER = "torch.utils.tensorboard.writer"
_BOOKKEEPING = ("file_version", "session_log")  # events that describe the event file


# Training libraries whose loops flor follows by wrapping their methods (a
# module name -> follow(module, patch)), registered by their followers
# (flor/huggingface.py) when flor's process starts (runtime/entry.py).
_FOLLOWERS: dict = {}


def follower(name, hook):
    """Call `hook(module, patch=...)` when a session's script imports the
    module `name` (or at the session's start if it is imported already);
    what it patches, the session's end puts back."""
    _FOLLOWERS[name] = hook


class _Then:
    """A module's loader that calls `hook(module)` once the module is executed;
    everything else is the loader's."""

    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Watch:
    """An import hook (first on sys.meta_path) for the modules to patch."""

    def __init__(self, hooks):
        self.hooks = hooks  # module name -> hook(module)

    def find_spec(self, name, path=None, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Then(spec.loader, hook)
        return spec


class _BarStream:
    """Where a progress bar of the script writes instead of the capture: the
    real stream when `live`, while nothing is suppressed; else nowhere."""

    def __init__(self, effects, real, captured, live):
        self._fx, self._real, self._captured, self._live = effects, real, captured, live

    def write(self, text):
        if self._live and not self._fx.quiet():
            return self._real.write(text)
        return len(text)

    def flush(self):
        if self._live:
            self._real.flush()

    def __eq__(self, other):
        # tqdm.write() clears the bars that write where it writes (sys.stdout)
        return other is self or other is self._captured or other is self._real

    __hash__ = object.__hash__

    def __getattr__(self, name):
        return getattr(self._real, name)


class Effects:
    """The patches of one session (see the module's docstring)."""

    def __init__(self, session, files=False):
        self.s = session
        self._patches = []  # (owner, attribute, original, replacement)
        self._busy = threading.local()
        self._watch = None
        self.files = None
        # A copy of a slow segment's worker (workers.py), started once the
        # first run of the segment was past its set-up: that run wrote the
        # files the set-up writes.
        self.copy = os.environ.pop("FLOR_REPLAY_COPY", None) == "1" and session.replaying
        hooks = {"logging": self._logging, _WRITER: self._tensorboard, "tqdm.std": self._tqdm}
        for name, hook in _FOLLOWERS.items():
            hooks[name] = functools.partial(hook, patch=self._patch)
        pending = {}
        for name, hook in hooks.items():
            module = sys.modules.get(name)
            if module is not None:
                hook(module)
            else:
                pending[name] = hook
        if pending:
            self._watch = _Watch(pending)
            sys.meta_path.insert(0, self._watch)
        # Record: what blocks write to files, for replay to write again.
        self.journal = None
        # Only a replay and record --resume ever discard what the script does.
        self._may_discard = session.replaying or not getattr(session.policy, "restored", True)
        if files:
            from .files import Files

            if not session.replaying:
                from .filewrites import WriteJournal

                self.journal = WriteJournal(session)
            self.files = Files(self)

    # -- the rules ------------------------------------------------------------

    def _mine(self) -> bool:
        s = self.s
        return not s.finished and s.pid == os.getpid()

    def quiet(self) -> bool:
        """Whether what the script writes now must not happen."""
        s = self.s
        if not self._mine():
            return False
        return s.discard or (s.phase == PRE and s.part > 0)

    def files_quiet(self) -> bool:
        """Whether what the script writes to its files (and TensorBoard
        event files) now must not happen (files.py): when anything must not,
        and in a copy's set-up."""
        if not self._may_discard:
            return False
        return self.quiet() or (self.copy and self.s.phase == PRE and self._mine())

    def user_code(self, code) -> bool:
        return self.s.logbook.is_user_file(code.co_filename)

    def files_claim(self, file, act):
        """A part of a replay writes `file` (files.py's Files.claim); outside
        a replay (record --resume appends) nothing is done."""
        if self.files is not None and self.s.replaying:
            self.files.claim(file, act)

    def _store(self, name, value, loc):
        """A value at the session's context, as flor.log stores it."""
        s = self.s
        if not self._mine() or s.discard or getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            s.logbook.value(name, value, loc)
        finally:
            self._busy.on = False

    def _user_site(self, frame):
        """The location of the innermost frame of the user's program from
        `frame` out, or None."""
        while frame is not None:
            if self.user_code(frame.f_code):
                return self.s.site(frame)
            frame = frame.f_back
        return None

    # -- patching -------------------------------------------------------------

    def _patch(self, owner, name, make):
        original = owner.__dict__.get(name)
        if original is None:
            return
        call = getattr(owner, name)  # a function (tqdm's __init__ is a partialmethod)
        replacement = functools.wraps(call)(make(call))
        setattr(owner, name, replacement)
        self._patches.append((owner, name, original, replacement))

    def restore(self):
        """Put back what this session replaced, where it is still its own."""
        if self._watch is not None and self._watch in sys.meta_path:
            sys.meta_path.remove(self._watch)
        self._watch = None
        if self.files is not None:
            self.files.restore()
        for owner, name, original, replacement in reversed(self._patches):
            if owner.__dict__.get(name) is replacement:
                setattr(owner, name, original)
        self._patches = []

    # -- logging --------------------------------------------------------------

    def _logging(self, logging):
        fx = self

        def make(original):
            def callHandlers(logger, record):
                if fx.quiet():
                    return None
                fx._logged(record)
                return original(logger, record)
            return callHandlers

        self._patch(logging.Logger, "callHandlers", make)
        # What a handler writes to stdout is not a printed line of the
        # statement that logged (its format may hold the time): the record's
        # message is stored as its value instead.
        self.s.logbook.barriers += (make(None).__code__,)

    def _logged(self, record):
        path = getattr(record, "pathname", None)
        if not self._mine() or not path or not self.s.logbook.is_user_file(path):
            return
        try:
            message = record.getMessage()
        except Exception:  # the handlers report a bad format as logging does
            return
        self._store(LOG + record.name, message, self.s.site_of(path, record.lineno))

    # -- TensorBoard ----------------------------------------------------------

    def _tensorboard(self, writer):
        fx = self

        def add_event(original):
            def add_event(self, event, *args, **kwargs):
                if fx.files_quiet() and event.WhichOneof("what") not in _BOOKKEEPING:
                    return None
                return original(self, event, *args, **kwargs)
            return add_event

        def add_scalar(original):
            def add_scalar(self, tag, scalar_value, *args, **kwargs):
                out = original(self, tag, scalar_value, *args, **kwargs)
                fx._scalars({str(tag): scalar_value}, sys._getframe(1))
                return out
            return add_scalar

        def add_scalars(original):
            def add_scalars(self, main_tag, tag_scalar_dict, *args, **kwargs):
                out = original(self, main_tag, tag_scalar_dict, *args, **kwargs)
                fx._scalars({f"{main_tag}/{t}": v for t, v in tag_scalar_dict.items()},
                            sys._getframe(1))
                return out
            return add_scalars

        def skipped(original):
            def quiet_or(self, *args, **kwargs):
                if fx.files_quiet():  # (event files are files)
                    return None
                return original(self, *args, **kwargs)
            return quiet_or

        self._patch(writer.FileWriter, "add_event", add_event)
        self._patch(writer.SummaryWriter, "add_scalar", add_scalar)
        self._patch(writer.SummaryWriter, "add_scalars", add_scalars)
        self._patch(writer.SummaryWriter, "add_embedding", skipped)

    def _scalars(self, values, frame):
        if not self._mine() or self.s.discard:
            return
        loc = self._user_site(frame)
        if loc is None:
            return
        from .logbook import jsonable

        for tag, value in values.items():
            try:
                number = float(jsonable(value))
            except (TypeError, ValueError):
                continue  # not a number (a Caffe2 blob name)
            self._store(TB + tag, number, loc)

    # -- progress bars --------------------------------------------------------

    def _tqdm(self, std):
        fx = self

        def make(original):
            def __init__(self, *args, **kwargs):
                if len(args) > 4:  # (iterable, desc, total, leave, file, ...)
                    args = (*args[:4], fx._bar_file(args[4]), *args[5:])
                else:
                    kwargs["file"] = fx._bar_file(kwargs.get("file"))
                original(self, *args, **kwargs)
            return __init__

        self._patch(std.tqdm, "__init__", make)

    def _bar_file(self, file):
        """Where a new bar writes: the stream behind the capture, if it was
        to write to a captured stream."""
        if file is None:
            file = sys.stderr
        real = self.s.capture.real_of(file) if self._mine() else None
        if real is None:
            return file
        return _BarStream(self, real, file, self.s.capture.tee)
