"""The tracked loops of a session (session.py): numbering them, the index
of each iteration, and the one iterator every tracked loop runs through.

The main loop of a record, of ``record --resume`` and of a replay segment
run through the same code; what differs between them is a `Span`, which
the session's policy (policy.py) gives for a top-level loop: where this
process starts the loop (from an iteration checkpoint, or pseudoresuming
the iterations before it), where it stops, and whether it then draws the
loop's iterable to its end.  At the end of a top-level iteration the
policy fingerprints the training state, may checkpoint what the loop
carries (carry.py), and the session flushes what the iteration stored.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .. import _core, config
from ..context import MAIN, POST
from ..errors import FlorError, FlorReplayError, SegmentDone, note
from . import carry

__all__ = ["Loops", "Span", "LoopRun"]


class LoopRun(NamedTuple):
    """One run of a tracked loop, once it closed."""

    loop: str
    run: int
    depth: int  # 0: a top-level loop
    iterations: int
    seconds: float


@dataclass(frozen=True)
class Span:
    """The iterations of a top-level loop that this process runs."""

    start: int = 0  # the first iteration it works; those before are pseudoresumed
    # (their output dropped), or restored when `restore` is given
    end: int | None = None  # it stops before this iteration (None: when the iterable ends)
    drain: bool = False  # at `end`, draw once more, so that the iterable ends as it did
    # in the record (its code after its last item runs)
    stop: int | None = None  # then end the process's part: SegmentDone(stop)
    restore: Callable | None = None  # read(tag) -> the iteration checkpoint of start - 1
    where: str = ""  # that checkpoint, in messages
    refusal: str | None = None  # a restore that fails is FlorError(f"{refusal}: ..."),
    # not the FlorReplayError a replay worker's queue recovers from
    phases: bool = False  # the session's phase is "main" while it runs, "post" after

    def own_to_end(self, n) -> bool:
        """Whether the iterations from n on are all worked, to the end of the
        iterable, and the phase stays (record --resume past its restore)."""
        return n >= self.start and self.end is None and self.stop is None and not self.phases


def _config_of(frame) -> config.Config | None:
    """The script's configuration (flor/config.py), or None with a note
    where reading it failed: that never stops the script."""
    try:
        return config.capture(frame)
    except Exception as e:  # a config object whose attributes raise when read
        note(f"the script's configuration was not stored: reading it raised {e!r}")
        return None


class Loops:
    def __init__(self, session):
        self.s = session
        self.stats: list[LoopRun] = []  # as each one closes
        self.ended: set[tuple[str, int]] = set()  # loops whose iterable ended (not a break)
        self.blocks_run = 0  # blocks entered in the current top-level iteration
        self.resumed = None  # (loop, values to rebind) after an iteration restore
        self.began: dict = {}  # top-level (loop, run) -> when its first iteration here began
        # top-level (loop, run) -> torch's thread count as it began (the
        # script may set another after the loop)
        self.threads: dict = {}
        # The script's configuration as the first top-level iteration this
        # process runs began (flor/config.py); None where none was found
        self.config: config.Config | None = None
        self._config_read = False
        self._main = None  # (loop, run, iterations) of the main loop so far
        self._main_end = 0.0  # when its latest iteration ended (time.time())
        # top-level loop -> flor's seconds at the iterations of its runs that
        # ended (LoopFrame.own: the one running)
        self.own: dict[str, float] = {}

    def loop(self, iterable, name, frame, carrier=None):
        """A tracked loop; `carrier` (carry.py) says what it carries from one
        iteration to the next, if it is the main loop."""
        s = self.s
        key = name or s.site(frame, structural=True)
        run = s.context.next("L", key, s.where.ctx)
        span = s.policy.span(s, key, run, carrier) if s.context.at_top_level() else None
        return self._iterate(iterable, key, run, frame, carrier, span)

    def _iterate(self, iterable, key, run, scope, carrier, span):
        """Yield the loop's items, its index part of the context of what each
        iteration runs."""
        s = self.s
        depth = s.context.depth()
        frame = s.context.push_loop(key, run, scope)
        frame.carrier = carrier if depth == 0 else None
        if span is not None and span.phases:
            s.phase = MAIN
        t0, n, back = time.perf_counter(), 0, None
        it = iter(iterable)
        positioned = True  # False while a restore that positions the loop has not succeeded
        try:
            if span is not None and span.restore is not None and span.start > 0:
                positioned, n = False, span.start
                self._restore(it, frame, span)
                positioned = True
            while span is None or span.end is None or n < span.end:
                if span is not None:
                    pseudo = n < span.start
                    s.machine.phase = _core.PSEUDORESUME_PHASE if pseudo else _core.WORK
                    s.discard = pseudo  # before the item is drawn: what that prints is its own
                # What runs while the item is drawn (a generator's code)
                # belongs to the iteration that gets it.
                s.context.set_index(frame, n)
                if depth == 0 and not self._config_read and not s.replaying:
                    self._config_read = True  # (a replay has its record's)
                    self.config = _config_of(sys._getframe(1))
                if depth == 0 and n == 0:
                    s.logbook.random_state(frame)
                    torch = sys.modules.get("torch")
                    if torch is not None:
                        self.threads[(key, run)] = torch.get_num_threads()
                if back is not None:  # flor's time since the body ended, less drawing the item
                    frame.own += time.perf_counter() - back
                    back = None
                try:
                    x = next(it)
                except StopIteration:
                    self.ended.add((key, run))
                    break
                if depth == 0:
                    got = time.perf_counter()
                    if (key, run) not in self.began:
                        self.began[(key, run)] = time.time()
                    s.policy.iteration_started(s, frame)
                    frame.own += time.perf_counter() - got
                n += 1
                yield x
                if depth == 0:
                    back = time.perf_counter()
                    self.end_iteration(frame, progress=span is not None and n > span.start)
                    q = s.policy.quiet_steps(s, frame, it, n) \
                        if span is None or span.own_to_end(n) else None
                    if q is not None:  # a step loop's quiet iterations, run in C
                        frame.own += time.perf_counter() - back
                        back = None
                        try:
                            yield from q
                        finally:
                            status, drawn, _, _, own, _ = s.policy.quiet_done(s, frame, q, n)
                            n += drawn
                            frame.own += own
                            s.own_time.add(own)
                        back = time.perf_counter()
                        if status == _core.QUIET_ENDED:
                            self.ended.add((key, run))
                            break
                        if status == _core.QUIET_OPEN:
                            self.end_iteration(frame, progress=span is not None and n > span.start)
            else:
                if span.drain:
                    self._draw_to_end(it, frame, key, n)
        finally:
            if frame.handle is not None:  # left by break or an exception
                s.policy.iteration_abandoned(s, frame)
            if span is not None and positioned:  # (a refused restore leaves discard as it was)
                s.discard = False
                s.machine.phase = _core.WORK
            if back is not None:
                frame.own += time.perf_counter() - back
            if depth == 0:
                self.own[key] = self.own.get(key, 0.0) + frame.own
            s.context.remove(frame)
            self.stats.append(LoopRun(key, run, depth, n, time.perf_counter() - t0))
            if span is not None and span.phases:
                s.phase = POST
        if span is not None and span.stop is not None:
            raise SegmentDone(span.stop)

    def _restore(self, it, frame, span):
        """Start the loop at span.start from the iteration checkpoint of the
        iteration before it (verified: carry.resume_at); the items before it
        are drawn with their output dropped.  A restore that fails leaves
        the session discarding as it was."""
        s = self.s
        t0 = time.perf_counter()
        before, s.discard = s.discard, True
        try:
            values, labels, unverified = carry.resume_at(s.context, it, frame, frame.carrier,
                                                         span.start, span.restore, span.where)
        except FlorReplayError as e:
            s.discard = before
            if span.refusal is None:
                raise
            raise FlorError(f"{span.refusal}: {e}") from None
        except BaseException:
            s.discard = before
            raise
        s.discard = False
        if values is not None:
            self.resumed = (frame[1], values)
        s.policy.resumed(s, frame, labels, unverified, time.perf_counter() - t0)
        return span.start

    def _draw_to_end(self, it, frame, key, n):
        """The record's loop ended with its iterable: draw it once more, as
        the record did."""
        self.s.context.set_index(frame, n)
        try:
            next(it)
        except StopIteration:
            self.ended.add((key, frame[2]))
            return
        note(f"the main loop at {key} yields more than the {n} items it yielded in the "
             f"record; the replay stops it after {n}")

    def end_iteration(self, frame, progress):
        """A top-level loop's iteration ended: fingerprint the training state
        in its scope, if blocks ran in it, checkpoint what the loop carries
        (when the rule says so), and store what it logged.  The policy takes
        the fingerprint (`state()`) once the iteration's own time is
        measured: it is flor's time, not the iteration's.  `progress`: an
        iteration of the process's own (not pseudoresumed)."""
        s = self.s
        if frame.t0 is not None and not self.blocks_run:  # maybe quiet (recording.py)
            t0 = time.perf_counter()
            if s.policy.quiet_end(s, frame):
                s.own_time.add(time.perf_counter() - t0)
                return
        with s.own_time:
            ran, self.blocks_run = self.blocks_run, 0
            frame.ran = ran

            def state():
                return s.logbook.iteration_state(frame) if ran else None

            s.policy.iteration_done(s, progress, frame, state)
            s.context.forget_finished()
            s.policy.iteration_stored(s, frame)
            if s.policy.flush_due(s):
                t0 = time.perf_counter()
                s.logbook.settle()  # any wait for the GPU before the store's lock is taken
                with s.store.transaction():  # one commit per flush
                    s.flush()
                s.policy.flushed(s, frame, time.perf_counter() - t0)

    def own_seconds(self, frame) -> float:
        """Flor's seconds at the iterations of top-level loop `frame`'s
        runs so far, outside what the iterations' bodies run (drawing the
        items is the script's): a step loop's bookkeeping."""
        return self.own.get(frame[1], 0.0) + frame.own

    def main_so_far(self, frame, now=None):
        """Top-level iteration `frame` is done (at `now`, time.time()):
        (loop, run, iterations done) if its loop is the main loop so far
        (the top-level loop that has run longest, from its first
        iteration's start to its latest iteration's end), else None."""
        loop, run, i = frame[1:4]
        now = time.time() if now is None else now
        best = self._main
        if best is None or (best[0] == loop and best[1] == run) or \
                now - self.began.get((loop, run), now) >= self._main_end - self.began[best[:2]]:
            self._main, self._main_end = (loop, run, i + 1), now
            return self._main
        return None

    def startup_s(self) -> float | None:
        """Seconds from the session's start to the first top-level iteration:
        what a replay worker pays before its main loop."""
        first = min(self.began.values(), default=None)
        return None if first is None else first - self.s.started

    def take_resumed(self, key):
        """Hands-free: the values the loop `key` rebinds after a restore of
        its iteration checkpoint (once), else None."""
        got = self.resumed
        if got is not None and got[0] == key:
            self.resumed = None
            return got[1]
        return None
