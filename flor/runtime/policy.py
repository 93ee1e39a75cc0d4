"""What a session (session.py) leaves to its policy: the hooks where record
(recording.py) and a replay worker (replaying.py) differ, each with its
default here.

The session calls a hook at each point below; a hook gets the session and
reads or changes it only through its public attributes (its context,
logbook, capture, phase and discard).  Where a policy never meets a hook's
situation (the C state machine never gives a record a block to skip), the
default says so by raising.
"""
from __future__ import annotations

import time

from ..context import location

__all__ = ["Policy", "FLUSH_S"]

FLUSH_S = 1.0  # rows wait in memory at most this long between flushes (and the end's)


class Policy:
    mode: str  # "record" or "replay"
    first_phase: str | None = None  # the session's phase before the main loop
    part: int = 0  # the replay part this process runs (record: 0)

    # Set by each policy: the run store, the skip-block state machine
    # (flor._core.SkipMachine), the run stored to, the state fingerprints'
    # version (flor/runtime/blockstate.py).
    store = machine = run_id = fingerprint_version = None

    # -- identity -----------------------------------------------------------

    def location(self, rel, line, structural) -> str:
        """The location of line `line` of file `rel` (context.location):
        replay maps an edited file's lines to the recorded ones."""
        return location(rel, line)

    def saw_file(self, path, rel):
        """The program called flor or printed from a file for the first time."""

    def flushing(self, session):
        """What the policy stores with each flush (record: the program's
        files, and how far the run got)."""

    # -- loops (loops.py) ---------------------------------------------------

    def span(self, session, key, run, carrier):
        """The `loops.Span` of top-level loop `key` (its run `run`): the
        iterations this process runs; None for the whole loop, as it comes."""
        return None

    def resumed(self, session, frame, labels, unverified, seconds):
        """The loop `frame` resumes from an iteration checkpoint (its
        span's): `labels` name what was put back, `unverified` what could
        not be checked, in `seconds`."""

    def iteration_started(self, session, frame):
        """A top-level iteration starts (its item is drawn)."""

    def quiet_steps(self, session, frame, it, n):
        """A run of quiet iterations of a main loop from iteration n on
        (recording.py), or None: each iteration then ends through
        iteration_done()."""
        return None

    def quiet_done(self, session, frame, q, n):
        """The run `q` of quiet_steps() stopped; returns its outcome()."""
        raise NotImplementedError

    def iteration_abandoned(self, session, frame):
        """A break or an exception left a top-level iteration."""

    def block_abandoned(self, session, key):
        """The body of block `key` raised: it closes without an end()."""

    def iteration_done(self, session, progress, frame, state):
        """A top-level iteration ended; `state()` fingerprints the training
        state (once: call it, whatever else the policy does), `progress`:
        the iteration is the process's own, not pseudoresumed."""
        state()

    def flush_due(self, session) -> bool:
        """Whether what the ended top-level iteration stored is flushed to
        the store now, or waits for a later iteration's flush or the end's."""
        return True

    _flushed = 0.0  # time.monotonic() of the last flush

    def flushed(self, session, frame, seconds):
        """The flush at the end of top-level iteration `frame` took `seconds`."""

    def quiet_end(self, session, frame) -> bool:
        """A top-level iteration in which no block ran ended: whether the
        policy did all there is to do at its end (else Loops.end_iteration
        does it)."""
        return False

    def flushed_a_while_ago(self) -> bool:
        """Whether FLUSH_S passed since the last flush (and if so, one
        starts now): a commit per iteration of a step loop costs about what
        a small training step does."""
        now = time.monotonic()
        if now - self._flushed < FLUSH_S:
            return False
        self._flushed = now
        return True

    def iteration_stored(self, session, frame):
        """A top-level iteration ended; what it stored goes to the store
        with the next flush."""

    # -- blocks (session.py: step_into and end) ------------------------------

    def recorded_value(self, name, loc, ctx):
        """Replay: the value the record logged as `name` at (`loc`, `ctx`)
        (decoded), else None; None in a record."""
        return None

    def checkpoint_for(self, session, key, ctx, occurrence, probed, expect_sig):
        """(checkpoint payload or None, seconds to load it, probed) for the
        execution `occurrence` of block `key` in context `ctx`: a block with
        a checkpoint (and not probed) is skipped.  `expect_sig` (hands-free,
        a blockstate.Expected): what its end() will capture."""
        return None, 0.0, probed

    def entered(self, session, key, ctx, occurrence, state):
        """The state machine put the execution in `state` (_core.EXECUTE...)."""

    def executed(self, session, block, objs, seconds, sig, grads, frame):
        """A block body that ran as record runs it ended (EXECUTE)."""
        raise AssertionError(f"{self.mode} never executes a block as record does")

    def ran_again(self, session, block, objs, sig):
        """A block body that replay stepped into ended (STEP_INTO)."""
        raise AssertionError(f"{self.mode} never steps into a block")

    def restore(self, session, block, objs, sig, rebind, hint, frame):
        """A skipped block's end(): restore `objs` (SKIP, PSEUDORESUME);
        returns what end() returns."""
        raise AssertionError(f"{self.mode} never skips a block")

    # -- the end ------------------------------------------------------------

    def close(self) -> list:
        """Make every checkpoint durable; returns the writes that failed."""
        return []

    def finish(self, session, error, failures):
        """Store what the run measured (`error`: what ended it, if not its end)."""
