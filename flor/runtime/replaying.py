"""Replay: the session policy of a replay worker (``python -m flor replay``).

The worker runs the edited script with one segment [start, end) of the
plan's main-loop iterations.  The main loop (loops.py, as this policy's
`span` says) yields iterations [0, end), or [start, end) from the iteration
checkpoint before `start` where the plan has one:
those before `start` are pseudoresumed (blocks restored from their
checkpoints, or run where there is none; their output is discarded), those
in the segment are replayed (probed blocks run, the others are restored).
A worker that is not the last stops when its segment ends (SegmentDone).

A checkpoint is used only after checking, before restoring anything, that
it is the checkpoint of the block execution asking for it (its block,
context and occurrence) and that it holds what the edited script's end()
call would capture; otherwise the block runs, and the worker says why.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .. import _core, trust
from ..context import PRE, block_context, location, within
from ..errors import CheckpointCorrupt, FlorReplayError, SegmentDone, StoreError, note
from ..runinfo import PartInfo
from ..schema import BLOCKRUNS
from . import blockstate, filewrites, ranks
from .logbook import RecordedFingerprints
from .loops import Span
from .policy import Policy

__all__ = ["Replaying"]

# A worker reports its progress at most this often (and at its first
# iteration): a report per iteration woke the replay's parent thousands of
# times a second, beside workers that have every core.
REPORT_S = 0.1

STATE_NAMES = {_core.EXECUTE: "execute", _core.SKIP: "skip", _core.STEP_INTO: "step_into",
               _core.PSEUDORESUME: "pseudoresume"}


class Replaying(Policy):
    mode = "replay"
    first_phase = PRE

    def __init__(self, store, plan, part, progress_fd=None, resume=True):
        self.store, self.plan, self.part = store, plan, part
        self.resume = resume  # start from an iteration checkpoint where the plan has one
        self.resumed_from = None  # [iteration, seconds] of the restore
        self.unverified = []  # what the restore put back and could not verify
        self.restored_labels = []  # the labels of what it put back
        self.run_id = plan.replay_id
        self.segment = plan.segments[part]
        self.last_part = part == len(plan.segments) - 1
        self.main = (plan.main_loop, plan.main_run)
        self.machine = _core.SkipMachine(_core.REPLAY, plan.epsilon, plan.c)
        self.progress_fd = progress_fd
        if progress_fd is not None:
            try:  # the script's children (os.system, a process left running) do not get it
                os.set_inheritable(progress_fd, False)
            except OSError:
                self.progress_fd = None
        self._report_at = 0.0  # when the next progress report is due
        self.main_seen = False
        self.reexecuted = 0
        self._sig_noted: set[str] = set()
        self._rewrite_noted: set[str] = set()  # blocks whose file writes cannot be redone
        self._safe_noted = False
        self.recorded = type(store)(plan.store)  # the record's rows (a part may store elsewhere)
        self.fingerprints = RecordedFingerprints.of(self.recorded, plan)
        self.fingerprint_version = self.fingerprints.version
        self._recorded_at, self._recorded_rows = None, {}  # the record's, of one iteration
        self._recorded_values: dict = {}  # name -> {(loc, ctx): value} (recorded_value)
        # Its checkpoints' header tags name it: a file of another run is refused.
        self.tag_run = blockstate.tag_run(plan.record, self.recorded.run(plan.record)["info"])
        store.clear_part(self.run_id, part)
        store.set_part(self.run_id, part, "running")

    # -- identity -----------------------------------------------------------

    def location(self, rel, line, structural):
        """In recorded line numbers: the edited file is mapped to the recorded one."""
        fmap = self.plan.files.get(rel)
        if fmap is None:
            return location(rel, line)
        old = fmap.sites.get(line) if structural else None
        return location(rel, line, old if old is not None else fmap.lines.get(line), mapped=True)

    # -- the main loop ------------------------------------------------------

    def span(self, session, key, run, carrier):
        """The main loop yields the worker's segment of the recorded
        iterations, from the iteration checkpoint before it where the plan
        has one (else pseudoresuming the iterations before it)."""
        if (key, run) != self.main:
            return None
        self.main_seen = True
        start, end = self.segment
        fname = self.plan.resume.get(start - 1) if start > 0 and self.resume and \
            carrier is not None else None
        where = f"iteration checkpoint {fname}"

        def read(expect):
            try:
                saved, how = self._read(fname, expect)
            except blockstate.UNREADABLE as e:
                raise FlorReplayError(f"{where} cannot be read ({e})") from None
            self._how_read(fname, how)
            return saved

        return Span(start=start, end=min(end, self.plan.iterations),
                    drain=self.last_part and self.plan.ended,
                    stop=None if self.last_part else self.part,
                    restore=read if fname is not None else None, where=where, phases=True)

    def resumed(self, session, frame, labels, unverified, seconds):
        self.restored_labels, self.unverified = labels, unverified
        self.resumed_from = [self.segment[0] - 1, seconds]

    def flush_due(self, session) -> bool:
        """At most once every FLUSH_S (nothing reads a worker's rows before
        it finishes: a killed worker's segment runs again into a new
        database), and where the script wrote to stderr: a worker that
        dies without finishing is reported with the last lines it wrote."""
        wrote = session.capture.stderr_written()
        return self.flushed_a_while_ago() or wrote

    def iteration_done(self, session, progress, frame, state):
        state()
        if progress and self.progress_fd is not None:
            index = session.context.top()[1]
            now = time.monotonic()
            if now < self._report_at and index + 1 < self.segment[1]:
                return
            self._report_at = now + REPORT_S
            try:  # the segment's iterations done so far
                os.write(self.progress_fd, f"{index + 1 - self.segment[0]}\n".encode())
            except OSError:
                self.progress_fd = None

    # -- blocks -------------------------------------------------------------

    def recorded_value(self, name, loc, ctx):
        values = self._recorded_values.get(name)
        if values is None:
            values = self._recorded_values[name] = {
                (r["loc"], r["ctx"]): r["value"]
                for r in self.recorded.logged(self.plan.record, [name], printed=False)}
        got = values.get((loc, ctx))
        return None if got is None else json.loads(got)

    def checkpoint_for(self, session, key, ctx, occurrence, probed, expect_sig):
        """(checkpoint, seconds to load it, probed) for a block execution:
        None where the block runs instead."""
        probed = probed or key in self.plan.probed
        if not self.machine.wants(probed) or key in self.plan.changed_end:
            return None, 0.0, probed
        t0 = time.perf_counter()
        payload = self._load(key, ctx, occurrence)
        load_s = time.perf_counter() - t0
        if payload is not None:  # what it wrote to files must be written again here
            why = filewrites.unrewritable(session.effects.files, self._recorded(
                session, block_context(ctx, key, occurrence), "writes"))
            if why is not None:
                payload = self._reexecuted(key, why, self._rewrite_noted)
        if payload is not None and expect_sig is not None:
            if payload["sig"] != expect_sig.sig:
                why = (f"its checkpoints hold {payload['sig']}, the edited script needs "
                       f"{expect_sig.sig}")
            else:
                why = blockstate.unrestorable(payload, expect_sig)
            if why is not None:
                payload = self._reexecuted(key, why, self._sig_noted)
        return payload, load_s, probed

    def _reexecuted(self, key, why, noted) -> None:
        """An execution of block `key` runs although it has a checkpoint
        (`why`): said once per block and reason (`noted`), and counted.
        Returns the payload it restores: None."""
        if key not in noted:
            noted.add(key)
            note(f"block {key}: {why}; re-executing it")
        self.reexecuted += 1
        return None

    def _load(self, key, ctx, occurrence):
        fname = self.plan.checkpoints.get((key, ctx, occurrence))
        where = f"block {key!r} at {json.loads(ctx) or 'the top level'}"
        if fname is None:
            self.reexecuted += 1  # record did not checkpoint this execution
            return None
        try:
            payload, how = self._read(fname, blockstate.tag(key, ctx, occurrence))
        except FileNotFoundError:
            note(f"checkpoint {fname} is missing; re-executing {where}")
        except CheckpointCorrupt as e:
            note(f"{e}; re-executing {where}")
        except trust.Mismatch:
            note(f"checkpoint {fname} does not belong to {where} of run {self.plan.record} "
                 "(its header says so; nothing of it was unpickled); re-executing it")
        except trust.Forged as e:
            note(f"{e}; re-executing {where}")
        except StoreError as e:
            note(f"{e}; re-executing {where}")
        except trust.UnsafeCheckpoint as e:
            note(f"checkpoint {fname} is not signed with this user's key "
                 f"({trust.key_path()}), and safe loading refuses it: it names the global "
                 f"{e.global_name}; re-executing {where}")
        else:
            if blockstate.belongs(payload, key, ctx, occurrence):
                self._how_read(fname, how)
                return payload
            note(f"checkpoint {fname} does not belong to {where}; re-executing it")
        self.reexecuted += 1

    def _read(self, fname, expect):
        return ranks.read(self.plan.ckpt_dir, fname, blockstate.expected(expect, self.tag_run),
                          self.plan.ranks, self.plan.sealed)

    def _how_read(self, fname, how):
        """Say, once, that checkpoints without a valid signature load in safe mode."""
        if how == "safe" and not self._safe_noted:
            self._safe_noted = True
            note(f"checkpoint {fname} is not signed with this user's key "
                 f"({trust.key_path()}): it was loaded in safe mode (tensors, containers and "
                 "numbers only), as are any others like it")

    def entered(self, session, key, ctx, occurrence, state):
        session.logbook.blockruns.append(BLOCKRUNS.Row(
            run_id=self.run_id, part=self.part, phase=session.phase, block=key, ctx=ctx,
            occurrence=occurrence, state=STATE_NAMES[state]))

    def ran_again(self, session, b, objs, sig):
        """A block that ran again: fingerprint its state where the record
        checkpointed the same execution, to compare (not when its end() call
        changed: it may hand over other objects, or the same in another order)."""
        if not session.discard and b.key not in self.plan.changed_end and \
                (b.key, b.ctx, b.occurrence) in self.plan.checkpoints:
            session.logbook.state(b, sig, objs)

    def restore(self, session, b, objs, sig, rebind, hint, frame):
        """A skipped block's end(): restore `objs` from its checkpoint."""
        t0 = time.perf_counter()
        saved = b.payload
        if saved["sig"] != sig:
            raise FlorReplayError(
                f"SkipBlock {b.key!r}: its checkpoint holds {saved['sig']} but end() received "
                f"{sig}. The program changed after record, so flor cannot skip "
                f"this block; {hint}")
        out = blockstate.apply(saved, objs, rebind, frame)
        self.machine.restored(b.handle, b.load_s + time.perf_counter() - t0)
        if not session.discard:
            for row in self._recorded(session, _inside(b), "output"):
                session.capture.emit(row["stream"], row["text"])
        # What it wrote to files, written again (suppressed like the script's
        # own writes where its output is discarded).
        filewrites.rewrite(session.effects.files, self._recorded(session, _inside(b), "writes"))
        return out

    def _recorded(self, session, inside, what):
        """What the record printed ("output") or wrote to files ("writes")
        inside a block execution (`inside`: its context), in order."""
        where = (session.where.top, session.where.top_iter)
        if self._recorded_at != where:
            self._recorded_at, self._recorded_rows = where, {}
        rows = self._recorded_rows.get(what)
        if rows is None:
            by_block = self.recorded.output_by_block if what == "output" else \
                self.recorded.writes_by_block
            rows = self._recorded_rows[what] = by_block(self.plan.record, *where)
        return [r for r in rows if r["ctx"] is not None and within(r["ctx"], inside)]

    # -- the end ------------------------------------------------------------

    def finish(self, session, error, failures):
        failed = error is not None and not isinstance(error, SegmentDone)
        torch = sys.modules.get("torch")
        if not self.main_seen and not failed and self.main[0] is not None:
            note(f"the recorded main loop ({self.main[0]}) never ran in this replay; "
                 "the whole script ran in every worker")
        self.store.durable()  # what the part wrote stays, once it says it finished
        self.store.set_part(self.run_id, self.part, "failed" if failed else "finished",
                            time.time() - session.started,
                            PartInfo(reexecuted=self.reexecuted,
                                     threads=torch.get_num_threads() if torch is not None
                                     else None,
                                     main_seen=self.main_seen, resumed_from=self.resumed_from,
                                     unverified=self.unverified, restored=self.restored_labels,
                                     captured=session.block_labels,
                                     error=repr(error) if failed else None))


def _inside(b) -> str:
    """The context inside block execution `b`."""
    return block_context(b.ctx, b.key, b.occurrence)
