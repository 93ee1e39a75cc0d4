"""The record side of the main loop: iteration checkpoints (flor/runtime/carry.py
says what they hold), the run's progress committed at every iteration, and
the main loop of ``record --resume``.  A mixin of `Recording`
(recording.py), whose rule (`_checkpoint`) decides iteration checkpoints as
it decides block checkpoints."""
from __future__ import annotations

import os
import time

from ..context import iteration_key
from ..errors import FlorError, FlorReplayError, note
from . import blockstate, carry

__all__ = ["RecordIterations"]


class RecordIterations:
    def loop(self, session, iterable, key, run, scope, carrier=None):
        r = self.point
        if not self.restored and session.at_top_level() and (key, run) == (r.loop, r.loop_run):
            if carrier is None:
                raise FlorError(f"the main loop at {key} no longer says what it carries "
                                "(state=): run {r.run_id} cannot be resumed")
            return session.iterate(iterable, key, run, scope, carrier, start=r.start)
        return session.iterate(iterable, key, run, scope, carrier)

    def resume(self, session, it, frame, start):
        """Skip the main loop to `start` from the iteration checkpoint of the
        iteration before it (verified), and record from there."""
        r = self.point
        where = f"iteration checkpoint {r.file} of run {r.run_id}"
        path = os.path.join(self.store.ckpt_dir(self.run_id), r.file)
        try:
            carry.resume_at(session, it, frame, frame.carrier, start,
                            lambda expect: blockstate.read_own(path, expect)[0], where)
        except FlorReplayError as e:
            raise FlorError(f"cannot resume: {e}") from None
        session.logbook.journal.ord = r.ord
        session.discard = False
        self.restored = True
        self._loop_t0[(frame[1], frame[2])] = time.time()
        note(f"resuming run {r.run_id} at iteration {start} of its main loop")

    def iteration_started(self, session, frame):
        if frame.carrier is not None:
            key = iteration_key(frame[1])
            frame.handle = self.machine.block(key)
            self.machine.enter(frame.handle, False, False)
            self.charges.started(key, self.writes.writing())
        self._loop_t0.setdefault((frame[1], frame[2]), time.time())
        if self._startup is None:  # what a replay worker pays before the main loop
            self._startup = time.time() - session.started

    def iteration_abandoned(self, session, frame):
        try:
            self.machine.leave(frame.handle)
        except RuntimeError:
            pass  # an exception left a block open inside the iteration
        frame.handle = None

    def iteration_done(self, session, progress, frame, state):
        """Fingerprint the state (`state()`), and checkpoint what the main
        loop carries out of this iteration if the adaptive rule says so."""
        if frame.handle is None:
            state()
            return
        handle, frame.handle = frame.handle, None
        _, seconds = self.machine.leave(handle)
        fp = state()
        objs, sig, _ = frame.carrier.capture(frame.scope)
        loop, run, i = frame[1:4]

        def make():  # only for a checkpoint: its restore is verified by these
            got = fp if fp is not None else carry.fingerprint(frame.scope,
                                                              self.fingerprint_version)
            return carry.payload(loop, run, i, objs, sig, got, session.logbook.journal.ord,
                                 carry.digests(objs, frame.scope))

        # The checkpoint is charged its fingerprint, wherever it was taken.
        self._checkpoint(session, iteration_key(loop), handle, session.info[1], 0, seconds,
                         objs, make, session.logbook.fingerprint_s if fp is not None else 0.0,
                         unheld=blockstate.unheld(sig))

    def iteration_committed(self, session, frame):
        """What the run stored so far is committed: the run row says how far
        it got (the main loop so far: the top-level loop running longest)."""
        loop, run, i = frame[1:4]
        if self.point is not None and self.point.start and \
                (loop, run) != (self.point.loop, self.point.loop_run):
            return  # a record resumed from a checkpoint knows its main loop
        now = time.time()
        mine = now - self._loop_t0.get((loop, run), now)
        best = self._main_so_far
        if best is None or best[:2] == (loop, run) or mine >= now - self._loop_t0[best[:2]]:
            self._main_so_far = (loop, run, i + 1)
            self.store.update_run(self.run_id, main_loop=loop, main_run=run, iterations=i + 1)
