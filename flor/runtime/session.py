"""The state behind flor.generator, flor.SkipBlock and flor.log in one process.

A `Session` tracks loops, blocks and logs, and leaves what differs between
record and replay to its policy:

- `Recording` (recording.py): every block body runs; at end() the adaptive
  rule decides whether to checkpoint the block's side effects.
- `Replaying` (replaying.py): the main loop yields the worker's segment of
  the recorded iterations (pseudoresuming those before it); a block that was
  not probed is skipped and end() restores it from its checkpoint.

A process that does not record (``FLOR_MODE=off``, a forked DataLoader
worker) gets an `Inert` session: flor calls run the code and store nothing.

Identity (flor/context.py): everything stored is keyed by its context, the
enclosing loop iterations and block executions, so a checkpoint, a logged
value or a decision belongs to exactly one execution.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import time

from .. import _core
from ..context import Context, PLAIN, PRE, Where
from ..errors import StoreError, note
from ..schema import BLOCKS, LOOPS
from ..store import Store
from .blockstate import signature
from .capture import Capture
from .effects import Effects
from .logbook import Logbook
from .loops import Loops

__all__ = ["Session", "Inert"]

BODY_RUNS = (_core.EXECUTE, _core.STEP_INTO)


class OwnTime:
    """Seconds flor itself spends on the main thread: ``with own_time:``
    around flor's work (a call nested in another is not counted twice)."""

    def __init__(self):
        self.seconds = 0.0
        self._depth, self._t0 = 0, 0.0

    def __enter__(self):
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0

    def add(self, seconds):
        """flor's work took `seconds`, timed apart (unless within a `with`)."""
        if self._depth == 0:
            self.seconds += seconds


def _accounted(method):
    """A session method whose time is flor's own (OwnTime)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        with self.own_time:
            return method(self, *args, **kwargs)
    return timed


def _ret(objs):
    if len(objs) == 0:
        return None
    return objs[0] if len(objs) == 1 else tuple(objs)


class Inert:
    """The session of a process that does not record."""

    mode = "off"
    replaying = False

    def __init__(self):
        self.pid = os.getpid()
        self.block_labels: dict = {}

    def loop(self, iterable, name, frame, carrier=None):
        return iter(iterable)

    def take_resumed(self, key):
        return None

    def step_into(self, name, probed, frame, expect_sig=None):
        return True

    def end(self, objs, frame, sig=None, rebind=None, as_list=False, hint=None, grads=False):
        return list(objs) if as_list else _ret(objs)

    def abandon(self):
        pass

    def log(self, name, value, frame):
        pass

    def at_top_level(self):
        return False  # nothing is tracked

    def innermost_loop(self):
        return None

    def open_plain(self):
        pass

    def close_plain(self):
        return True


class Session:
    _current: "Session | Inert | None" = None

    @classmethod
    def get(cls) -> "Session | Inert":
        s = cls._current
        if s is not None and s.pid == os.getpid():
            return s
        if s is not None:
            # A forked child of a flor process (a DataLoader worker): inert.
            cls._current = Inert()
            return cls._current
        mode = os.environ.pop("FLOR_MODE", "record").lower()
        if mode == "off":
            cls._current = Inert()
        elif mode == "record":
            main = sys.modules.get("__main__")
            try:
                cls._current = cls.record(getattr(main, "__file__", None), sys.argv,
                                          watch_exceptions=True)
            except StoreError as e:  # the script cannot record: say why, and stop it
                note(str(e))
                raise SystemExit(2) from None
        else:
            raise ValueError(f"FLOR_MODE must be record or off, not {mode!r}; replay runs "
                             "through `python -m flor replay`")
        return cls._current

    @classmethod
    def record(cls, script, argv, epsilon=None, adaptive=None, store=None,
               watch_exceptions=False, hands_free=None, resume=None, keep=None) -> "Session":
        """Start recording `script` (its instrumented code `hands_free`);
        `resume`: continue an interrupted record (flor/runtime/resume.py)."""
        from .recording import Recording

        policy = Recording(store or Store(), script, argv, epsilon, adaptive, hands_free,
                           resume, keep)
        cls._current = cls(policy, script, tee=True, stderr=False,
                           watch_exceptions=watch_exceptions)
        if not policy.restored:
            cls._current.discard = True  # until the main loop is restored: stored already
        return cls._current

    @classmethod
    def replay(cls, plan, part, store=None, tee=False, progress_fd=None,
               resume=True) -> "Session":
        """Start replaying segment `part` of `plan` (a flor.replay.plan.Plan);
        `resume`: from an iteration checkpoint where the plan has one."""
        from .replaying import Replaying

        policy = Replaying(store or Store(plan.store), plan, part, progress_fd, resume)
        cls._current = cls(policy, plan.script, tee=tee, stderr=True, watch_exceptions=False)
        return cls._current

    def __init__(self, policy, script, tee, stderr, watch_exceptions):
        self.policy = policy
        self.mode = policy.mode
        self.replaying = policy.mode == "replay"
        self.store, self.machine = policy.store, policy.machine
        self.run_id, self.part = policy.run_id, policy.part
        self.pid = os.getpid()
        self.script = os.path.abspath(script) if script else None
        self.base = os.path.dirname(self.script) if self.script else os.getcwd()
        self.project_files: set[str] = set()  # the project's modules instrumented (project.py)
        self.context = Context(self._context_changed)
        self.logbook = Logbook(self)
        self._phase = policy.first_phase
        self.where = None  # a Where (flor/context.py): see _context_changed
        self._context_changed()
        self.names: dict[str, str] = {}  # block name -> its call site
        self.loops = Loops(self)
        self.seen_files: set[str] = set()
        self.block_labels: dict[str, list] = {}  # hands-free: what each block captured
        self.started = time.time()
        self.own_time = OwnTime()
        self.finished = False
        self.capture = Capture(self.logbook.journal, tee, stderr, watch_exceptions)
        self._show()
        # Files the script writes are guarded (files.py): in record, what its
        # blocks write is journaled for replay to write again.
        self.effects = Effects(self, files=True)
        atexit.register(self.finish)

    # -- where the run is -----------------------------------------------------

    def _context_changed(self):
        """Keep `where`, what every value and output row is stored with, current."""
        self.where = self.context.where(self._phase)
        self.logbook.journal.info = self.where

    @property
    def phase(self):
        """Replay: "pre", "main" and "post" around the main loop; None in record."""
        return self._phase

    @phase.setter
    def phase(self, value):
        self._phase = value
        self._context_changed()
        self._show()

    @property
    def discard(self) -> bool:
        """Replay: what a pseudoresumed iteration logs or prints is dropped."""
        return not self.logbook.journal.capturing

    @discard.setter
    def discard(self, value):
        self.logbook.journal.capturing = not value
        self._show()

    def _show(self):
        """A replay part shows (`replay --part`) the output that is its own:
        not its pseudoresumed iterations, and the set-up before the main
        loop only in part 0."""
        capture = getattr(self, "capture", None)
        if self.replaying and capture is not None:
            capture.show(not self.discard and not (self._phase == PRE and self.part > 0))

    # -- identity -----------------------------------------------------------

    def site(self, frame, structural=False) -> str:
        """The location of a frame's current line (flor/context.py).
        `structural` asks for the line of a loop or block call, which
        replay also maps by the order of such calls in the file."""
        return self.site_of(frame.f_code.co_filename, frame.f_lineno, structural)

    def site_of(self, filename, line, structural=False) -> str:
        fn = os.path.abspath(filename)
        rel = os.path.relpath(fn, self.base)
        if fn not in self.seen_files:
            self.seen_files.add(fn)
            self.policy.saw_file(fn, rel)
        return self.policy.location(rel, line, structural)

    # -- loops (loops.py) ---------------------------------------------------

    def loop(self, iterable, name, frame, carrier=None):
        """flor.generator: a tracked loop (Loops.loop)."""
        return self.loops.loop(iterable, name, frame, carrier)

    def take_resumed(self, key):
        return self.loops.take_resumed(key)

    def at_top_level(self) -> bool:
        return self.context.at_top_level()

    def innermost_loop(self):
        return self.context.innermost_loop()

    # -- blocks -------------------------------------------------------------

    @_accounted
    def step_into(self, name, probed, frame, expect_sig=None) -> bool:
        where = self.site(frame, structural=True)
        if name is not None:
            first = self.names.setdefault(name, where)
            if first != where:
                raise ValueError(
                    f"SkipBlock name {name!r} is used at {first} and at {where}; "
                    "give each block its own name")
        key = name or where
        handle = self.machine.block(key)
        ctx = self.where.ctx
        occurrence = self.context.next("B", key, ctx)
        payload, load_s, probed = self.policy.checkpoint_for(self, key, ctx, occurrence, probed,
                                                             expect_sig)
        state = self.machine.enter(handle, bool(probed), payload is not None)
        self.policy.entered(self, key, ctx, occurrence, state)
        self.context.push_block(key, occurrence, ctx, handle, state, payload, load_s)
        self.loops.blocks_run += 1
        return state in BODY_RUNS

    def open_plain(self):
        """A hands-free block that just runs (its loop is not tracked)."""
        self.context.push_plain()

    def close_plain(self) -> bool:
        """Close the innermost block if it is plain (or none is open)."""
        if self.context.innermost_block() in (PLAIN, None):
            self.context.pop_block()
            return True
        return False

    def abandon(self):
        """The innermost block's body raised: close it without a checkpoint."""
        b = self.context.pop_block()
        if b is not None and b is not PLAIN:
            self.machine.leave(b.handle)
            self.policy.block_abandoned(self, b.key)
            if self.effects.journal is not None:  # (to the block around it, if any)
                self.effects.journal.ended(b, kept=False)

    @_accounted
    def end(self, objs, frame, sig=None, rebind=None, as_list=False,
            hint="pass probed=True to its step_into() to re-execute it", grads=False):
        """Close the innermost block (see SkipBlock.end).  `sig` names the
        objects (default: their types); `rebind[i]` restores objs[i] by
        returning the saved value instead of updating it in place (objects
        with load_state_dict are always loaded in place); `grads`: the
        gradients of their parameters are state too."""
        ret = list if as_list else _ret
        if self.context.innermost_block() in (PLAIN, None):
            raise RuntimeError(
                "flor.SkipBlock.end() without a matching flor.SkipBlock.step_into()")
        b = self.context.pop_block()
        state, seconds = self.machine.leave(b.handle)
        sig = signature(objs) if sig is None else list(sig)
        if state == _core.EXECUTE:
            self.policy.executed(self, b, objs, seconds, sig, grads, frame)
            return ret(objs)
        if state == _core.STEP_INTO:
            self.policy.ran_again(self, b, objs, sig)
            return ret(objs)
        return ret(self.policy.restore(self, b, objs, sig, rebind, hint, frame))

    # -- logs and output ----------------------------------------------------

    @_accounted
    def log(self, name, value, frame):
        if self.discard:
            return
        self.logbook.value(name, value, self.site(frame))

    def flush(self):
        """Store what the run logged and printed so far (at the end of each
        top-level iteration, and at the end)."""
        self.policy.flushing(self)
        self.logbook.flush(self.store)

    # -- the end ------------------------------------------------------------

    def finish(self, error: BaseException | None = None):
        """Make every checkpoint durable and store what the run measured."""
        if self.finished or self.pid != os.getpid():
            return
        self.finished = True
        error = error if error is not None else self.capture.error
        self.effects.restore()
        self.capture.restore()
        failures = self.policy.close() + self.logbook.close()
        self.flush()
        self.store.add_blocks([
            BLOCKS.Row(run_id=self.run_id, part=self.part, block=s["key"], n=s["n"], k=s["k"],
                       compute_s=s["compute_s"], materialize_s=s["materialize_s"],
                       restore_s=s["restore_s"], restores=s["restores"], skips=s["skips"],
                       steps=s["steps"], nbytes=s["nbytes"]) for s in self.machine.stats()])
        self.store.add_loops([LOOPS.Row(run_id=self.run_id, part=self.part, **row._asdict())
                              for row in self.loops.stats])
        self.policy.finish(self, error, failures)
