"""Record: the session policy of a recording script.

Every block body runs.  At a block's end() the adaptive rule (the C state
machine, csrc/skipblock.c) weighs M, the seconds a checkpoint of the
block's side effects costs training (measured by runtime/charge.py), and
the time to write and restore it (a file's fixed time, plus its bytes,
measured by the snapshot walk, over this machine's write bandwidth:
runtime/writes.py's Speeds), against C, the block's mean compute time;
a checkpoint that passes is handed, with the random state, to a background
Materializer.  Each decision and its reason is stored.  At a main loop's
iterations the rule also weighs flor's own time there (B), and is not asked
where it cannot say yes (charge.py's Waits) nor, once a loop has all the
iteration checkpoints a record keeps, before a new one is due
(thinning.py's Thinning.due).  The run's row in the store is recordrow.py's.
"""
from __future__ import annotations

import math
import os
import time

from .. import _core
from ..context import Where, checkpoint_name, is_iteration, iter_column, iteration_key
from ..errors import INTERRUPTIONS, CheckpointWriteError, FlorError, note
from ..layout import checkpoint_path
from ..program.gradients import manual_gradients, manual_loop_gradients
from ..schema import DECISIONS
from ..seal import seal_run
from . import blockstate, carry, charge, ranks
from .charge import Charges, StateReads, Waits
from .logbook import FingerprintBudget
from .loops import Span
from .policy import FLUSH_S, Policy
from .recordrow import RecordRow
from .thinning import DEFAULT_LIMIT, Thinning, limit_from_env
from .writes import Writes

__all__ = ["Recording", "DEFAULT_EPSILON", "DEFAULT_C"]

DEFAULT_EPSILON = 1 / 15
DEFAULT_C = 1.38


def epsilon_from_env() -> float:
    """FLOR_EPSILON (as --epsilon), else DEFAULT_EPSILON."""
    text = os.environ.get("FLOR_EPSILON", "").strip()
    if not text:
        return DEFAULT_EPSILON
    try:
        eps = float(text)
    except ValueError:
        eps = math.nan
    if not 0 < eps < math.inf:
        raise FlorError(f"FLOR_EPSILON must be a number above 0 (the record overhead the "
                        f"adaptive rule allows, as --epsilon), not {text!r}")
    return eps


def estimate_c(store, script_name) -> float:
    """Restore time over materialize time, from earlier replays of this
    script: the median over blocks of (seconds per restore) / (estimated
    seconds per checkpoint).  1.38 (the paper's measurement) until then."""
    if script_name is None:
        return DEFAULT_C
    ratios = sorted(store.restore_ratios(script_name))
    return ratios[len(ratios) // 2] if ratios else DEFAULT_C


class Recording(Policy):
    mode = "record"
    fingerprint_version = blockstate.FINGERPRINT

    def __init__(self, store, script, argv, epsilon=None, adaptive=None, hands_free=None,
                 resume=None, keep=None):
        self.store = store
        eps = epsilon if epsilon is not None else epsilon_from_env()
        if adaptive is None:
            adaptive = os.environ.get("FLOR_ADAPTIVE", "1") not in ("0", "false", "off")
        if keep is None:  # a resumed record keeps what its previous part kept
            keep = limit_from_env((store.run(resume.run_id)["info"].iteration_checkpoints
                                   if resume is not None else None) or DEFAULT_LIMIT)
        self.thinning = Thinning(keep)
        self.script = os.path.abspath(script) if script else None
        # The ranks of a torchrun launch record one run (flor/runtime/ranks.py).
        self.group = ranks.Group.join(resuming=resume is not None)
        if resume is not None:  # the interrupted run's rule goes on
            run = store.run(resume.run_id)
            eps, c = run["epsilon"], run["c"]
        else:
            c = estimate_c(store, os.path.basename(script) if script else None)
        self.machine = _core.SkipMachine(_core.RECORD, eps, c, adaptive)
        # A quarter of the overhead the rule allows goes to state fingerprints;
        # --no-adaptive takes one at every iteration, as it checkpoints every block.
        self.fingerprints = FingerprintBudget(eps / 4) if adaptive else None
        self.point = resume  # a flor.runtime.resume.ResumePoint
        self.restored = resume is None or resume.start == 0
        self.row = RecordRow(store, self.script, argv, eps, c, adaptive, hands_free, resume,
                             self.group, self.fingerprint_version, keep)
        self.run_id, source = self.row.run_id, self.row.source
        # The header tags of its checkpoints name the run (rank 0's).
        self.tag_run = blockstate.tag_run(self.run_id, self.row.info)
        # Manual API: blocks whose gradients are read after their end(), and
        # main loops whose iterations carry gradients to the next.
        manual = source is not None and hands_free is None
        self.grad_blocks = manual_gradients(source, os.path.basename(script)) if manual else set()
        self.grad_loops = manual_loop_gradients(source, os.path.basename(script)) \
            if manual else set()
        self.states = StateReads(FLUSH_S)
        self.checkpointed = False  # whether the last top-level iteration was checkpointed
        self.progress = None  # (main loop, run, iterations) for the run row's next flush
        self.charges = Charges()
        self.waits = Waits()
        # The rule is asked at every iteration without adaptivity (it says yes
        # to each), and by every rank of a data-parallel group (each follows
        # the first to get there).
        self.waiting = adaptive and self.group is None
        self._iterations: dict[str, tuple] = {}  # loop: (key, handle) of its iterations' block
        # iteration key: (flor's own time, what checkpoints blocked, one-time
        # work) as the second iteration of its loop this process runs began
        # (_bookkeeping; `record --resume` starts mid-loop), and the loop
        # frame whose first iteration it waits for
        self._base: dict[str, tuple] = {}
        self._first: dict[str, object] = {}
        self._sources: list[tuple[str, str]] = []  # files to keep with the run
        # The project's modules instrumented (runtime/project.py): their
        # summaries by path, and the sources to keep at the next flush.
        self.modules = store.layout.handsfree_modules(self.run_id) if resume else {}
        self._module_sources: list[tuple[str, str]] = []
        self._sealed_main = None  # the main loop so far the run's seal covers
        self.writes = Writes(store, self.run_id, adaptive)

    # -- identity -----------------------------------------------------------

    def saw_file(self, path, rel):
        """A file of the program called flor or printed: replay compares its
        source, so the run keeps it (stored at the next flush)."""
        if path != self.script and not rel.startswith("..") and os.path.isfile(path) \
                and rel not in self.modules:
            self._sources.append((path, rel))

    def instrumented_module(self, rel, source, inst):
        """A module of the project was instrumented as it was imported: the
        run keeps the source it ran and its summary (at the next flush)."""
        self.modules[rel] = inst.summary()
        self._module_sources.append((rel, source))

    def flushing(self, session):
        """The sources of the program's files seen since the last flush, and
        the run row's progress as of the last iteration that ended (so that
        it counts what the flush stores)."""
        pending, self._sources = self._sources, []
        for path, rel in pending:
            with open(path) as f:
                self.store.layout.save_module_source(self.run_id, rel, f.read())
        modules, self._module_sources = self._module_sources, []
        for rel, text in modules:
            self.store.layout.save_module_source(self.run_id, rel, text)
        if modules:
            self.store.layout.save_handsfree_modules(self.run_id, self.modules)
        changed = bool(pending or modules)  # what replay takes from the store
        removed = {name + ".flor" for name in self.thinning.take_removed()}
        if removed:  # rows of this flush among them too
            why = (f"; removed later: a record keeps {self.thinning.limit} iteration "
                   "checkpoints of a loop (--iteration-checkpoints)")
            self.store.checkpoints_removed(self.run_id, removed, why)
            session.logbook.decisions = [
                d._replace(checkpoint=0, file=None, reason=d.reason + why)
                if d.file in removed else d for d in session.logbook.decisions]
        if self.progress is not None:
            main, self.progress = self.progress, None
            self.store.update_run(self.run_id, main_loop=main[0], main_run=main[1],
                                  iterations=main[2])
            if (main[0], main[1]) != self._sealed_main:
                self._sealed_main = (main[0], main[1])
                changed = True
        if changed:  # seal the run again
            seal_run(self.store, self.run_id)

    # -- the main loop ------------------------------------------------------

    def span(self, session, key, run, carrier):
        """``record --resume``: the interrupted run's main loop starts at the
        iteration after its last iteration checkpoint, from that checkpoint
        (verified), and records from there."""
        r = self.point
        if self.restored or (key, run) != (r.loop, r.loop_run):
            return None
        if carrier is None:
            raise FlorError(f"the main loop at {key} no longer says what it carries "
                            f"(state=): run {r.run_id} cannot be resumed")
        path = checkpoint_path(self.store.layout.ckpt_dir(self.run_id), r.file)
        return Span(start=r.start, restore=lambda expect: blockstate.read_own(
                        path, blockstate.expected(expect, self.tag_run))[0],
                    where=f"iteration checkpoint {r.file} of run {r.run_id}",
                    refusal="cannot resume")

    def resumed(self, session, frame, labels, unverified, seconds):
        r = self.point
        session.logbook.journal.ord = r.ord
        self.restored = True
        self.thinning.resumed_at(frame[1], frame[2], r.start - 1)
        note(f"resuming run {r.run_id} at iteration {r.start} of its main loop")

    def iteration_started(self, session, frame):
        """An iteration of a loop that carries state is a block of its own,
        which the rule may checkpoint at its end.  At an iteration where the
        rule is not asked (Waits, Thinning.due) of a loop whose last
        iteration ran no block, with no checkpoint being written, the
        iteration is only timed: a step loop's every step pays that alone."""
        if frame.carrier is None:
            return
        key, handle = self._iteration_block(frame[1])
        if key not in self._base:  # B counts from the second iteration this process runs
            if self._first.get(key) is frame:
                self._base[key] = self._spent(session, frame, key)
                del self._first[key]
            else:
                self._first[key] = frame
        frame.ask = not self.waiting or not (
            self.waits.waiting(key) or frame[3] < self.thinning.due(frame[1], frame[2]))
        if not frame.ask and not frame.ran and self.writes.idle():
            frame.t0 = time.perf_counter()
            return
        frame.handle = handle
        self.machine.enter(handle, False, False)
        self.charges.started(key, self.writes.writing())

    def _iteration_block(self, loop):
        """(key, handle) of the block an iteration of `loop` is (looked up
        once: a step loop starts one at every step)."""
        got = self._iterations.get(loop)
        if got is None:
            key = iteration_key(loop)
            got = self._iterations[loop] = (key, self.machine.block(key))
        return got

    def _spent(self, session, frame, key) -> tuple:
        return (session.loops.own_seconds(frame), self.charges.blocked(key),
                self.writes.setup_s)

    def _bookkeeping(self, session, frame, key) -> float:
        """B for the rule at `key`, the iterations of `frame`'s loop: flor's
        own time at them less what their checkpoints blocked (charged as M)
        and one-time work (calibrating the disk, making the materializer),
        from the end of the first iteration of it this process ran on (whose
        end holds the first calls of flor's code and the first reads of the
        state)."""
        base = self._base.get(key)
        if base is None:
            return 0.0
        own, blocked, setup = self._spent(session, frame, key)
        return max(0.0, own - base[0] - (blocked - base[1]) - (setup - base[2]))

    def quiet_end(self, session, frame) -> bool:
        """An iteration the rule is not asked at, in which no block ran, ends:
        it is accounted, and the run's progress noted, unless a flush or the
        removal of a thinned checkpoint is due (iteration_done then)."""
        if time.monotonic() - self._flushed >= FLUSH_S or self.thinning.pending():
            return False
        frame.ran = 0
        self._timed_end(frame)
        self.checkpointed = False
        session.context.forget_finished()
        self.iteration_stored(session, frame)
        return True

    def quiet_steps(self, session, frame, it, n):
        """After a quiet end of iteration n - 1 of a main loop: a run of the
        iterations from n on that are quiet too (_core.QuietSteps), or None.
        They are those the rule is not asked at (Waits, Thinning.due) while
        no block runs, no checkpoint is being written or removed and no
        flush is due; the run accounts each as quiet_end() would.  It stops
        at the first iteration that is not quiet and leaves it open, to end
        here: one in which the session's where changed (a loop or block
        opened), or by whose end a flush is due (the end of an iteration
        flushes)."""
        if frame.carrier is None or not self.waiting or frame.ran or frame.t0 is not None \
                or frame.handle is not None or frame.encoded is None:
            return None
        key, handle = self._iterations[frame[1]]
        if key not in self._base or session.context.frames != [frame] or self.machine.depth:
            return None
        quota = max(self.waits.left(key), self.thinning.due(frame[1], frame[2]) - n)
        deadline = self._flushed + FLUSH_S
        if quota < 1 or time.monotonic() >= deadline or self.thinning.pending() \
                or not self.writes.idle():
            return None
        head, top = frame.encoded
        return self.machine.quiet_steps(handle, it, frame, n, quota, deadline, session,
                                        session.logbook.journal, Where, session.phase, head,
                                        top)

    def quiet_done(self, session, frame, q, n):
        """A run of quiet iterations from iteration n stopped: account what
        it did (the Waits it used, the clean executions it timed, the run's
        progress); its last item's iteration, where the run left it open
        (QUIET_OPEN), ends as any other, frame.t0 its start.  Returns the
        run's outcome()."""
        got = q.outcome()
        status, drawn, accounted, clean, _, pending = got
        key = self._iterations[frame[1]][0]
        self.waits.used(key, drawn)
        if accounted:
            self.charges.clean(key, clean, accounted)
            self.checkpointed = False
            self.iteration_stored(session, (frame[0], frame[1], frame[2], n + accounted - 1))
        if status == _core.QUIET_OPEN:
            frame.t0, frame.ask = time.perf_counter() - pending, False
        return got

    def _timed_end(self, frame) -> str:
        """An iteration the rule is not asked at, only timed, ended: it counts
        in n and C (and as an execution no write overlapped, unless blocks
        ran in it, which are not timed apart).  Returns its block's key."""
        seconds, frame.t0 = time.perf_counter() - frame.t0, None
        key, handle = self._iterations[frame[1]]
        self.machine.ran(handle, seconds)
        if not frame.ran:
            self.charges.clean(key, seconds)
        return key

    def _thin(self, key):
        """Remove the iteration checkpoints thinning no longer keeps whose
        writes finished: part of what the checkpoints cost."""
        if self.thinning.pending():
            t0 = time.perf_counter()
            self.writes.thin(self.thinning)
            self.charges.paid(key, time.perf_counter() - t0)

    def iteration_abandoned(self, session, frame):
        try:
            self.machine.leave(frame.handle)
        except RuntimeError:
            pass  # an exception left a block open inside the iteration
        frame.handle = None
        self.charges.abandoned(iteration_key(frame[1]))

    def block_abandoned(self, session, key):
        self.charges.abandoned(key)

    def iteration_done(self, session, progress, frame, state):
        """Fingerprint the state (`state()`), and checkpoint what the main
        loop carries out of this iteration if the adaptive rule says so."""
        if frame.handle is None:
            if frame.t0 is not None:  # an iteration the rule is not asked at
                self._thin(self._timed_end(frame))
            state()
            self.checkpointed = False
            return
        handle, frame.handle = frame.handle, None
        _, seconds = self.machine.leave(handle)
        fp = state()
        loop, run, i = frame[1:4]
        key = self._iteration_block(loop)[0]
        if not frame.ask:  # timed as the slowdown of a write in progress, not decided
            self.charges.ended(key, seconds, self.writes.writing())
            self.checkpointed = False
            self._thin(key)
            return
        # What the loop carries, read from its scope when first needed.
        captured = []

        def carried():
            if not captured:
                captured.append(frame.carrier.capture(frame.scope))
            return captured[0]

        def make():  # only for a checkpoint: its restore is verified by these
            objs, sig, _ = carried()
            got = fp if fp is not None else carry.fingerprint(frame.scope,
                                                              self.fingerprint_version)
            grads = blockstate.gradients(blockstate.state_owners(objs, frame.scope)) \
                if frame.carrier.grads or loop in self.grad_loops else None
            return carry.payload(loop, run, i, objs, sig, got, session.logbook.journal.ord,
                                 carry.digests(objs, frame.scope), grads=grads,
                                 named=getattr(frame.carrier, "named", False))

        # The checkpoint is charged its fingerprint, wherever it was taken.
        name = self._checkpoint(
            session, key, handle, session.where.ctx, 0, seconds,
            lambda: carried()[0], make, session.logbook.fingerprint_s if fp is not None else 0.0,
            unheld=lambda: blockstate.unheld(carried()[1]),
            named=lambda: zip(frame.carrier.labels(carried()[1]), carried()[0]),
            spent=self._bookkeeping(session, frame, key))
        self.checkpointed = name is not None
        if name is not None:
            self.thinning.written(loop, run, i, name, len(self.writes.submitted) - 1)
        self._thin(key)

    def flush_due(self, session) -> bool:
        """At an iteration checkpoint (`record --resume` starts after the last
        one the store holds), else at most once every FLUSH_S: a killed
        record keeps what it committed, and resumes from its last iteration
        checkpoint anyway."""
        return self.flushed_a_while_ago() or self.checkpointed

    def flushed(self, session, frame, seconds):
        """A flush at an iteration checkpoint is part of what the checkpoint
        costs (the store learns of it, for `record --resume`)."""
        if self.checkpointed:
            self.charges.paid(self._iterations[frame[1]][0], seconds)

    def iteration_stored(self, session, frame):
        """How far the run got (the main loop so far: the top-level loop
        running longest), for the run row at the next flush."""
        if self.point is not None and self.point.start and \
                tuple(frame[1:3]) != (self.point.loop, self.point.loop_run):
            return  # a record resumed from a checkpoint knows its main loop
        main = session.loops.main_so_far(frame)
        if main is not None:
            self.progress = main

    # -- blocks -------------------------------------------------------------

    def checkpoint_for(self, session, key, ctx, occurrence, probed, expect_sig):
        self.charges.started(key, self.writes.writing())
        return None, 0.0, probed  # record runs every block

    def executed(self, session, b, objs, seconds, sig, grads, frame):
        """Decide whether to checkpoint this execution, and do it."""
        if grads or b.key in self.grad_blocks:
            grads = blockstate.gradients(blockstate.state_owners(objs, frame))
        else:
            grads = None
        journal = session.effects.journal
        name = self._checkpoint(session, b.key, b.handle, b.ctx, b.occurrence, seconds,
                                lambda: [list(objs), grads], lambda: blockstate.payload(
                                    b.key, b.ctx, b.occurrence, sig, objs, grads),
                                unheld=lambda: blockstate.unheld(sig),
                                named=lambda: zip(blockstate.labels(sig, objs), objs),
                                refused=journal.refusal(b) if journal is not None else None)
        if journal is not None:  # what it wrote to files, for replay to write again
            journal.ended(b, kept=name is not None)
        if name:
            t0 = time.perf_counter()
            session.logbook.state(b, sig, objs)
            self.charges.paid(b.key, time.perf_counter() - t0)

    def _checkpoint(self, session, key, handle, ctx, occurrence, seconds, objs, make,
                    made_s=0.0, unheld=list, named=list, refused=None, spent=0.0):
        """The adaptive rule for this execution of `key` (of `seconds`,
        changing `objs()`); if it says yes, submit the checkpoint `make()`
        (`made_s`: what training already paid towards it).  Stores the
        decision; returns the checkpoint's name or None.  An execution that
        changes what no checkpoint holds (`unheld()`) is never checkpointed.
        The state is read (`objs()`, `unheld()`) only to measure its size (at
        most once every FLUSH_S) and where the rule says yes: a step loop's
        iterations that are not checkpointed do not pay for reading what the
        loop carries.  A state that cannot be read or copied (`named()` says
        which object) is never checkpointed: the script runs on as it would
        without flor, and replay runs it again; so is an execution whose
        writes to files replay could not write again (`refused`, why).
        `spent`: flor's other seconds at the executions of `key` (a main
        loop's bookkeeping at each iteration), which share the bound."""
        t_ask = time.perf_counter()
        self.charges.ended(key, seconds, self.writes.writing())
        if session.discard:  # record --resume, before the main loop: stored already
            return None
        # A rank that leaves the replicated state to rank 0 weighs what rank 0
        # pays (all the bytes, a copy of them), never its own small writes:
        # whichever rank decides, the rule holds for the rank that writes.
        stand_in = self.group is not None and not self.group.owner
        nbytes, fresh = self.states.nbytes.get(key, 0), False
        t_read = time.perf_counter()
        if key not in self.states.uncaptured:
            try:
                nbytes, fresh = self.states.size(key, objs, lambda o: _core.measure(o, True),
                                                 keep=not stand_in)
            except Exception as e:  # noqa: BLE001 -- reading it for flor must not end the script
                self._uncaptured(key, named, e)
        read_s = time.perf_counter() - t_read
        speeds = self.writes.speeds()
        bw, copy_bw, write_s = speeds.write_bps, speeds.copy_bps, speeds.write_seconds(nbytes)
        M = self.charges.cost(key, nbytes, copy_bw, write_s, self.states.on_device.get(key, 0.0))
        decided = self.machine.decide(handle, nbytes, M, write_s, spent)
        ok, ratio, limit, M, _ = decided
        reason = charge.reason(self.machine, nbytes, write_s, decided, spent)
        t_read = time.perf_counter()
        held_by_none = self.states.unheld_of(key, unheld, fresh, ok)
        read_s += time.perf_counter() - t_read
        if held_by_none:  # replay runs it again (a worker: the iterations before its segment)
            ok, reason = False, f"no checkpoint: none holds {'; '.join(held_by_none)}"
        if key in self.states.uncaptured:
            ok, reason = False, f"no checkpoint: {self.states.uncaptured[key]}"
        elif refused is not None:
            ok, reason = False, f"no checkpoint: {refused}"
        if self.waiting and is_iteration(key):
            self.waits.asked(key, decided, self.machine.epsilon, spent,
                             time.perf_counter() - t_ask)
        if decided[0] and not ok:  # the rule's accounting (k, bytes) follows
            self.machine.overruled(handle, False, write_s, nbytes)
        if self.group is not None:  # every rank follows the first to get here
            ok, reason = self.group.follow(self.machine, handle, key, ctx, occurrence,
                                           (ok, reason), write_s, nbytes)
        fname = None
        _, _, top, top_iter, indices = session.where
        if ok:
            fname = checkpoint_name(key, ctx, occurrence, indices)
            self.writes.materializer()  # made before the clock starts: once per run
            made_s += read_s  # reading the state (what make() copies) is the checkpoint's
            t0 = time.perf_counter()
            try:
                payload = make()
                if self.group is not None:  # replicated state: written by rank 0 alone
                    payload = ranks.split(payload, self.group.rank)
                t1 = time.perf_counter()
                made_s += t1 - t0  # an iteration checkpoint's fingerprint, when taken here
                self.states.written(key, self.writes.submit(key, fname, payload, blockstate.expected(
                    blockstate.payload_tag(payload), self.tag_run)))
                self.charges.charged(key, made_s + (nbytes / copy_bw if stand_in and "replicated"
                                                    in payload else time.perf_counter() - t1))
            except CheckpointWriteError as e:
                note(f"checkpoint of block {key!r} failed: {e}")
                fname = None
            except Exception as e:  # noqa: BLE001 -- copying it for flor must not end the script
                ok, reason, fname = False, f"no checkpoint: {self._uncaptured(key, named, e)}", None
                self.machine.overruled(handle, False, write_s, nbytes)
        st = self.machine.stats(handle)
        session.logbook.decisions.append(DECISIONS.Row(
            run_id=self.run_id, block=key, ctx=ctx, occurrence=occurrence,
            iter=iter_column(indices), top=top, top_iter=top_iter, n=st["n"], k=st["k"],
            compute_s=seconds,
            mean_compute_s=st["compute_s"] / st["n"], nbytes=nbytes, bandwidth=bw,
            materialize_s=M, ratio=ratio if math.isfinite(ratio) else None, limit_value=limit,
            checkpoint=int(ok), reason=reason, file=fname + ".flor" if fname else None))
        return fname

    def _uncaptured(self, key, named, error) -> str:
        """`key`'s state cannot be checkpointed: say so once, and why."""
        if key in self.states.uncaptured:  # another rank's decision made it try again
            return self.states.uncaptured[key]
        why = self.states.cannot_capture(key, named, error)
        what = (f"the main loop {key[:-len(' (iteration)')]} is" if is_iteration(key)
                else f"block {key} is")
        note(f"{what} not checkpointed, and replay runs it again: {why}")
        return why

    # -- the end ------------------------------------------------------------

    def close(self) -> list:
        """Make every checkpoint durable, remove the iteration checkpoints
        not kept; returns the failed writes."""
        failures = self.writes.close()
        self.writes.thin(self.thinning, final=True)
        return failures

    def finish(self, session, error, failures):
        if isinstance(error, INTERRUPTIONS) or not self.restored:
            # SIGTERM or Ctrl-C, or a resume that did not get to its main
            # loop: the run stays interrupted, as far as it committed.
            self.row.interrupted()
            return
        self.row.finish(session, self.machine, self.point, error, failures)
