"""Loops of a `Session` (session.py): numbering them, tracking their
iterations, and what happens at the end of a top-level iteration (state
fingerprint, iteration checkpoint, flush, progress)."""
from __future__ import annotations

import functools
import time

__all__ = ["Loops"]


def _accounted(method):
    """Add the time spent in `method` to the session's own main-thread time
    (once: calls nested in another accounted call are not counted twice)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        if self._in_flor:
            return method(self, *args, **kwargs)
        self._in_flor = True
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.flor_s += time.perf_counter() - t0
            self._in_flor = False
    return timed


class Loops:
    def loop(self, iterable, name, frame, carrier=None):
        """A tracked loop; `carrier` (flor/runtime/carry.py) says what it
        carries from one iteration to the next, if it is the main loop."""
        key = name or self.site(frame, structural=True)
        run = self.context.next("L", key, self.info[1])
        return self.policy.loop(self, iterable, key, run, frame, carrier)

    def iterate(self, iterable, key, run, scope, carrier=None, start=0):
        """A tracked loop: its index is part of the context of what it runs.
        `start`: iterations already done (``record --resume``)."""
        depth = self.context.depth()
        frame = self.context.push_loop(key, run, scope)
        frame.carrier = carrier if depth == 0 else None
        t0, n = time.perf_counter(), start
        it = iter(iterable)
        try:
            if start:
                self.policy.resume(self, it, frame, start)
            while True:
                # What runs while the item is drawn (a generator's code)
                # belongs to the iteration that gets it: so in replay too.
                self.context.set_index(frame, n)
                if depth == 0 and n == 0:
                    self.logbook.random_state(frame)
                try:
                    x = next(it)
                except StopIteration:
                    self.ended.add((key, run))
                    break
                if depth == 0:
                    self.policy.iteration_started(self, frame)
                n += 1
                yield x
                if depth == 0:
                    self.end_iteration(frame)
        finally:
            if frame.handle is not None:  # left by break or an exception
                self.policy.iteration_abandoned(self, frame)
            self.context.remove(frame)
            self.loop_stats.append((key, run, depth, n, time.perf_counter() - t0))

    @_accounted
    def end_iteration(self, frame, progress=False):
        """A top-level loop's iteration ended: fingerprint the training state
        in its scope, if blocks ran in it, checkpoint what the loop carries
        (when the rule says so), and store what it logged.  The policy takes
        the fingerprint (`state()`) once the iteration's own time is
        measured: it is flor's time, not the iteration's."""
        ran, self._blocks_run = self._blocks_run, 0

        def state():
            return self.logbook.iteration_state(frame) if ran else None

        self.policy.iteration_done(self, progress, frame, state)
        self.context.forget_finished()
        self._flush()
        self.policy.iteration_committed(self, frame)

    def take_resumed(self, key):
        """Hands-free: the values the loop `key` rebinds after a restore of
        its iteration checkpoint (once), else None."""
        got = self.resumed
        if got is not None and got[0] == key:
            self.resumed = None
            return got[1]
        return None
