"""What a session stores as the run goes: logged values, output, the
adaptive rule's decisions and (replay) how each block ran.

Rows wait in memory and are written to the store, in one commit, at the
end of a top-level iteration (in a record, one that took an iteration
checkpoint, else at most once a second; in a replay worker at most once a
second: the policies' flush_due) and when the run finishes.  Output is journaled in C
(csrc/capture.c) in segments, consecutive writes of one statement in one
context; at a flush each segment becomes one row of the output table, with
the statement's location.  The store reads the printed lines of a
statement back from those rows as its values, ``stdout@file:line``
(Store.logs), so the deferred checks compare them like ``flor.log`` values.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .. import _core
from ..context import STATE_BLOCK, STATE_ITERATION, STATE_RANDOM, block_context, iter_column
from ..errors import note
from ..schema import LOGS, OUTPUT
from .blockstate import fingerprint, random_fingerprint, state_owners
from .capture import STREAMS

__all__ = ["Logbook", "FingerprintBudget", "RecordedFingerprints", "jsonable"]

_FLOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


ARRAY_INLINE = 1024  # elements: larger tensors and arrays are stored as files


def _large(value) -> bool:
    """A tensor or array too large to store as JSON."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.numel() > ARRAY_INLINE
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray) and value.size > ARRAY_INLINE


def jsonable(value):
    """Tensors and arrays become numbers (or nested lists of numbers)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.numel() == 1 else value.cpu().tolist()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return value.item() if value.size == 1 else value.tolist()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


def _line(code, offset) -> int:
    """The source line of the instruction at byte `offset` of `code`."""
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return line
    return code.co_firstlineno


class _BlockState:
    """A block-end state row's value, [CRC of the signature, fingerprint],
    until its row is stored: on a GPU the fingerprint is read only then,
    so that taking it does not wait for the kernels queued before it."""

    __slots__ = ("crc", "fp")

    def __init__(self, crc, fp):
        self.crc, self.fp = crc, fp

    def json(self) -> str:
        fp = self.fp if type(self.fp) is int else self.fp.value()
        return json.dumps([self.crc, fp])


class FingerprintBudget:
    """Record: which main-loop iterations end with a state fingerprint.

    A fingerprint reads every byte of the modules and optimizers in scope
    (on a GPU, on the device: no host copy), so it is record overhead like a
    checkpoint.  Per top-level loop: the first iteration that ran blocks is
    fingerprinted; after it, one is taken where the time the loop's
    fingerprints took so far, plus the last one's time again (this one's
    estimate), fits in `share` of the time since the end of that first
    iteration.  The deferred checks compare the fingerprints the record
    has."""

    def __init__(self, share):
        self.share = share
        self.loops: dict = {}  # (loop, run) -> [t0, seconds spent, last one's seconds]

    def due(self, loop, key) -> bool:
        got = self.loops.get(loop)
        if got is None:
            self.loops[loop] = [time.perf_counter(), 0.0, 0.0]
            return True
        t0, spent, cost = got
        return spent + cost <= self.share * (time.perf_counter() - t0)

    def took(self, loop, seconds):
        got = self.loops[loop]
        got[1] += seconds
        got[2] = seconds


class RecordedFingerprints:
    """Replay: a fingerprint where the record took one, at `keys` (location,
    context), since the checks compare only those; none under --tolerance.
    Of the `version` the record took (blockstate.fingerprint)."""

    def __init__(self, keys, version):
        self.keys = keys
        self.version = version

    @classmethod
    def of(cls, recorded, plan) -> "RecordedFingerprints":
        """Where the record of `plan` (its rows in the store `recorded`)
        took one."""
        run = recorded.run(plan.record)
        version = run["info"].fingerprint if run is not None else 1
        if plan.tolerance:
            return cls(set(), version)
        return cls({(r["loc"], r["ctx"]) for r in recorded.logged(plan.record, [STATE_ITERATION],
                                                                  printed=False)}, version)

    def due(self, loop, key) -> bool:
        return key in self.keys

    def took(self, loop, seconds):
        pass


class Logbook:
    """The pending rows of one session (see flor/store.py for the tables)."""

    def __init__(self, session):
        self.s = session
        self.logs, self.out, self.decisions, self.blockruns = [], [], [], []
        self.writes = []  # record: what blocks wrote to files (filewrites.py)
        self._unsettled = 0  # block-end state rows whose fingerprint is not read yet
        self.journal = _core.Journal(self._is_user_code)
        self._user_files: dict[str, bool] = {}
        # Code under which a library writes for a statement (a logging handler):
        # effects.py stores that value itself.
        self.barriers: tuple = ()
        self._values = None  # the Materializer of large values, once one is logged
        self._locs: dict = {}  # (id(code), instruction offset) -> (code, location)
        self.fingerprint_s = 0.0  # what the last state fingerprint took
        self._unfingerprinted: set = set()  # what a fingerprint could not read (noted once)

    def next_ord(self) -> int:
        """Rows of logs and output share one order."""
        self.journal.ord += 1
        return self.journal.ord

    def value(self, name, value, loc):
        """A flor.log value at the session's current context.  A large tensor
        or array is copied now and written to a file of the run in the
        background; the row refers to it."""
        s = self.s
        phase, ctx, top, _, indices = s.where
        seq = s.context.next("S", (name, loc), ctx)
        ord_ = self.next_ord()
        if _large(value):
            stored = self._store_array(value, f"p{s.part}-{ord_}")
        else:
            stored = jsonable(value)
        self.logs.append(LOGS.Row(run_id=s.run_id, part=s.part, ord=ord_, phase=phase, top=top,
                                  ctx=ctx, name=name, iter=iter_column(indices), seq=seq,
                                  value=json.dumps(stored), loc=loc))

    def _store_array(self, value, name) -> dict:
        if self._values is None:
            from ..materializer import Materializer

            self._values = Materializer(os.path.join(self.s.store.layout.run_dir(self.s.run_id),
                                                     "values"))
        if hasattr(value, "detach"):
            value = value.detach()
        self._values.submit(name, value)  # a copy now, the file later
        return {"$array": f"values/{name}.flor", "dtype": str(value.dtype).replace("torch.", ""),
                "shape": list(value.shape)}

    def close(self) -> list:
        """Make every stored value durable; returns the failed writes."""
        if self._values is None:
            return []
        from ..errors import CheckpointWriteError

        try:
            self._values.close()
        except CheckpointWriteError as e:
            note(f"logged values could not be stored: {e}")
            return e.failures
        return []

    def iteration_state(self, frame):
        """The fingerprint of the training state in scope of a top-level loop
        (its modules and optimizers) at the end of an iteration; returned,
        or None where the record's budget for fingerprints has no room."""
        if self.s.discard or frame.scope is None:
            return None
        budget, loop = self.s.policy.fingerprints, (frame[1], frame[2])
        if budget is not None and not budget.due(loop, (frame[1], self.s.where.ctx)):
            return None
        t0 = time.perf_counter()
        owners = state_owners([], frame.scope)
        fp = self._fingerprint(f"the main loop {frame[1]}", owners, later=False)
        self.fingerprint_s = time.perf_counter() - t0
        if fp is None:
            return None
        if budget is not None:
            budget.took(loop, self.fingerprint_s)
        if owners:
            self.value(STATE_ITERATION, fp, frame[1])
        return fp

    def random_state(self, frame):
        """At the start of a top-level loop: fingerprints of the global random
        states, which differ between runs of a script that draws unseeded
        random numbers."""
        if not self.s.discard:
            self.value(STATE_RANDOM, random_fingerprint(), frame[1])

    def state(self, b, sig, objs):
        """The fingerprint of a block execution's state at its end(): of what
        it captured (`sig` names it), with a CRC of `sig`, since only the
        same objects compare."""
        s = self.s
        phase, _, top, _, indices = s.where
        ctx = block_context(b.ctx, b.key, b.occurrence)
        fp = self._fingerprint(f"block {b.key}", list(objs), later=True)
        if fp is None:
            return
        value = _BlockState(_core.crc32c(json.dumps(sig).encode()), fp)
        self._unsettled += 1
        self.logs.append(LOGS.Row(run_id=s.run_id, part=s.part, ord=self.next_ord(),
                                  phase=phase, top=top, ctx=ctx, name=STATE_BLOCK,
                                  iter=iter_column(indices), seq=0, value=value, loc=b.key))

    def _fingerprint(self, what, objs, later):
        """The state fingerprint of `objs` (with `later`, read later where
        the version allows), or None where reading them raises (a
        state_dict() that fails, say): the script runs on, and `what` is
        noted once as not fingerprinted."""
        version = self.s.policy.fingerprint_version
        try:
            return fingerprint(objs, version, later=later and version >= 2)
        except Exception as e:  # noqa: BLE001 -- a check must not end the script
            if what not in self._unfingerprinted:
                self._unfingerprinted.add(what)
                note(f"the state of {what} cannot be fingerprinted, so no check compares it: "
                     f"{type(e).__name__}: {e}")
            return None

    def _is_user_code(self, code) -> bool | None:
        """Whether a code object belongs to a file of the user's program;
        None for a barrier (stdout written under it belongs to no statement)."""
        if any(code is b for b in self.barriers):
            return None
        return self.is_user_file(code.co_filename)

    def is_user_file(self, fn) -> bool:
        """Whether a file is one of the user's program: the script, a file
        under its directory that is neither flor's nor an installed library,
        or a module of the project that hands-free mode instrumented."""
        mine = self._user_files.get(fn)
        if mine is None:
            s = self.s
            path = os.path.abspath(fn)
            mine = self._user_files[fn] = (
                path == s.script or path in s.project_files or (path.startswith(s.base + os.sep)
                                     and not path.startswith(_FLOR_DIR)
                                     and "site-packages" not in path))
        return mine

    def digest(self):
        """Turn the journaled output into output rows."""
        s = self.s
        for ord_, stream, code, offset, where, text in self.journal.take():
            phase, ctx, top, it, _ = where
            loc = None
            if code is not None:
                # Keyed by id: hashing a code object walks its bytecode.
                known = self._locs.get((id(code), offset))
                if known is None:
                    loc = s.site_of(code.co_filename, _line(code, offset))
                    self._locs[(id(code), offset)] = (code, loc)  # keeps the id unique
                else:
                    loc = known[1]
            self.out.append(OUTPUT.Row(run_id=s.run_id, part=s.part, ord=ord_,
                                       stream=STREAMS[stream], phase=phase, top=top, iter=it,
                                       text=text, ctx=ctx, loc=loc))

    def settle(self):
        """Read the block-end fingerprints still being computed (on a GPU)
        into their rows, before a flush opens its transaction.  One that
        cannot be read (a CUDA error, which the script's next CUDA call
        meets too) is left out, and said; the other rows stay.  An
        interrupt while waiting leaves every row to the next flush."""
        if not self._unsettled:
            return
        rows = []
        for r in self.logs:
            if type(r.value) is _BlockState:
                try:
                    r = r._replace(value=r.value.json())
                except Exception as e:
                    note(f"the state fingerprint at the end of block {r.loc} could not be read "
                         f"({type(e).__name__}: {e}); it is not stored")
                    continue
            rows.append(r)
        self.logs, self._unsettled = rows, 0

    def flush(self, store):
        self.settle()
        self.digest()
        logs, out, dec, runs = self.logs, self.out, self.decisions, self.blockruns
        writes = self.writes
        self.logs, self.out, self.decisions, self.blockruns = [], [], [], []
        self.writes = []
        if not (logs or out or dec or runs or writes):
            return
        with store.transaction():  # one commit, not one per table
            store.add_logs(logs)
            store.add_output(out)
            store.add_decisions(dec)
            store.add_blockruns(runs)
            store.add_writes(writes)
