"""Deferred checks: the replay's values against the record's (causes.py
says why they differ).

A value is identified by its statement (its location, in recorded line
numbers), its context (the enclosing loop iterations and block executions,
flor/context.py) and its count within that context.  Every value that both
runs logged is compared, and a value the record logged is reported missing
when the replay should have logged it too: its statement is still in the
program and every block execution around it ran again.

The values are what statements logged (flor.log) and printed, and state
fingerprints (``state@...``): a checksum of the modules' and optimizers' tensors
(flor/runtime/blockstate.py) at each checkpointed block's end and at each
main-loop iteration's end.
Where replay reaches the same point by running code again, they must be
equal, whatever the script prints.  The random state where a top-level loop
starts is fingerprinted too, but only to explain other differences (a
script may leave a generator it never uses unseeded).  A check that
compared nothing says so and is not a pass.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from ..context import (PRINTED, STATE, STATE_BLOCK, STATE_ENTRY, STATE_ITERATION, STATE_RANDOM,
                       describe, enclosing_blocks, parse_location)
from ..runtime.blockstate import fingerprint_version
from .plan import Plan

__all__ = ["compare_logs", "CheckReport", "equal"]

RAN = ("step_into", "execute")




@dataclass
class CheckReport:
    compared: int = 0  # values compared: logged, printed and fingerprints
    lines: int = 0  # of which printed lines
    states: int = 0  # of which state fingerprints
    recorded: int = 0  # values the record has
    mismatches: list = field(default_factory=list)  # (loc, name, ctx, seq, recorded, replayed)
    missing: list = field(default_factory=list)  # (loc, name, ctx, seq, recorded)
    clock: list = field(default_factory=list)  # mismatches only in fields that read the clock
    random: list = field(default_factory=list)  # (loc, recorded, replayed) random states
    ambiguous: int = 0
    states_skipped: int = 0  # not compared under a tolerance
    states_older: int = 0  # not compared: the record took them with another fingerprint version
    boundaries: list = field(default_factory=list)  # what a segment's start did not verify
    causes: dict = field(default_factory=dict)  # loc -> likely cause
    run_causes: list = field(default_factory=list)  # likely causes for the whole run
    shown_loc: dict = field(default_factory=dict)  # recorded loc -> current file:line

    @property
    def verdict(self) -> str:
        """passed, failed, or nothing: no value was compared."""
        if self.mismatches or self.missing:
            return "failed"
        return "passed" if self.compared > len(self.clock) else "nothing"

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def _what(self) -> str:
        parts = [f"{self.compared - self.lines - self.states} logged values"]
        if self.lines > len(self.clock):
            parts.append(f"{self.lines - len(self.clock)} printed lines")
        if self.states:
            parts.append(f"{self.states} state fingerprints")
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]

    def summary(self, limit=10) -> str:
        return "\n".join([self._summary(limit)] + [f"  {b}" for b in self.boundaries])

    def _summary(self, limit) -> str:
        clock = (f"; {len(self.clock)} printed lines differ only in fields that read the clock "
                 "(not compared)" if self.clock else "")
        if self.states_skipped:
            clock += (f"; {self.states_skipped} state fingerprints were not compared "
                      "(--tolerance)")
        if self.states_older:
            clock += (f"; {self.states_older} state fingerprints were not compared (taken "
                      "by a version of flor that fingerprinted otherwise)")
        if self.verdict == "nothing":
            return (f"deferred checks compared nothing: of the {self.recorded} values the record "
                    "logged, printed or fingerprinted, the replay logged, printed or reached none "
                    f"again{clock}; nothing was verified")
        if self.passed:
            return (f"deferred checks passed: {self._what()} of unchanged statements equal the "
                    f"record's{clock}")
        lines = [f"deferred checks FAILED: of {self.compared + len(self.missing)} values the "
                 f"record logged, printed or fingerprinted, {len(self.mismatches)} differ and "
                 f"{len(self.missing)} were not logged again{clock}:"]
        for loc, name, ctx, seq, rec, rep in self.mismatches[:limit]:
            if name == STATE_ITERATION:
                lines.append(f"  the state at the end of {describe(ctx)} differs from the "
                             "record's")
            elif name == STATE_BLOCK:
                lines.append(f"  the state at the end of {describe(ctx)} differs from the "
                             "record's")
            else:
                lines.append(f"  {self._stmt(loc, name)} at {describe(ctx, seq)}: recorded "
                             f"{_show(rec)}, replayed {_show(rep)}")
        for loc, name, ctx, seq, rec in self.missing[:max(0, limit - len(self.mismatches))]:
            lines.append(f"  {self._stmt(loc, name)} at {describe(ctx, seq)}: recorded "
                         f"{_show(rec)}, not logged by the replay")
        more = len(self.mismatches) + len(self.missing) - limit
        if more > 0:
            lines.append(f"  ... and {more} more")
        shown = set()
        for loc, *_ in self.mismatches + self.missing:
            cause = self.causes.get(loc)
            if cause and cause not in shown:
                shown.add(cause)
                lines.append(f"  likely cause ({self.shown_loc.get(loc, loc)}): {cause}")
        return "\n".join(lines)

    def _stmt(self, loc, name):
        where = self.shown_loc.get(loc, loc)
        return f"{where} (printed)" if name.startswith(PRINTED) else f"{where} {name!r}"


def _show(value_json):
    try:
        value = json.loads(value_json)
    except (TypeError, ValueError):
        return str(value_json)
    if isinstance(value, dict) and ARRAY in value:
        return f"an array of {value['dtype']} {value['shape']}"
    return repr(value) if isinstance(value, str) else json.dumps(value)


_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf")


def equal(a, b, tolerance=0.0) -> bool:
    """Recorded and replayed values (decoded JSON): exact, or numbers within
    a relative `tolerance` (numbers inside printed lines too)."""
    if tolerance <= 0:
        return a == b
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b:
            return True
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= tolerance * max(abs(a), abs(b))
    if isinstance(a, str) and isinstance(b, str):
        na, nb = _NUMBER.findall(a), _NUMBER.findall(b)
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b) or len(na) != len(nb):
            return False
        return all(equal(float(x), float(y), tolerance) for x, y in zip(na, nb))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y, tolerance) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k], tolerance) for k in a)
    return a == b


ARRAY = "$array"  # a large logged tensor or array, stored in a file


def _arrays_equal(store, a, b, tolerance) -> bool:
    """Two logged values of which one at least is a stored array: equal
    shape and values (within a relative `tolerance`).  A missing file is
    a difference."""
    try:
        x, y = (store.layout.value(run, v) for run, v in (a, b))
    except (OSError, ValueError):
        return False
    import numpy as np

    x, y = (np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in (x, y))
    if x.shape != y.shape:
        return False
    if tolerance > 0:
        return bool(np.allclose(x, y, rtol=tolerance, atol=0.0, equal_nan=True))
    return bool(np.array_equal(x, y, equal_nan=True))


def _present(loc, files):
    rel, line, new = parse_location(loc)
    fmap = files.get(rel)
    return fmap is not None and not new and line is not None and line in fmap


def _version(fingerprint: str) -> int:
    """The version of a stored state fingerprint (an int, or [crc, int])."""
    value = json.loads(fingerprint)
    return fingerprint_version(value[-1] if isinstance(value, list) else value)


def compare_logs(store, record_id, replay_id, plan=None, tolerance=0.0) -> CheckReport:
    """Compare a replay's values with its record's (`plan`: the replay's
    Plan, read from the store when not given)."""
    if plan is None:
        plan = Plan.load(store.layout.plan_path(replay_id))
    report = CheckReport()
    recorded, seen_twice = {}, set()
    for r in store.logs(record_id):
        key = (r["loc"], r["name"], r["ctx"], r["seq"])
        if key in recorded:
            seen_twice.add(key)
        recorded[key] = r["value"]
    for key in seen_twice:  # cannot tell which value is which: not compared
        del recorded[key]
    report.ambiguous = len(seen_twice)
    replayed = {}
    for r in store.logs(replay_id):
        replayed[(r["loc"], r["name"], r["ctx"], r["seq"])] = r["value"]
    report.recorded = sum(1 for k in recorded if k[1] != STATE_RANDOM)
    def differ(rec, rep):
        # A stored array is a file of its own run: the same reference in two
        # runs names two files, so arrays are always compared by content.
        arrays = ARRAY in rec[:16] or ARRAY in rep[:16]
        if rec == rep and not arrays:
            return False
        a, b = json.loads(rec), json.loads(rep)
        if arrays:
            return not _arrays_equal(store, (record_id, a), (replay_id, b), tolerance)
        return not equal(a, b, tolerance)

    for key, value in replayed.items():
        if key in recorded and key[1] == STATE_RANDOM:
            report.random.append((key[0], json.loads(recorded[key]), json.loads(value)))
        elif key in recorded and key[1].startswith(STATE) and \
                _version(recorded[key]) != _version(value):
            report.states_older += 1  # a record resumed across versions of flor
        elif key in recorded:
            state = key[1].startswith(STATE)
            if state and tolerance > 0:
                report.states_skipped += 1  # an exact fingerprint cannot be near
                continue
            if key[1] == STATE_BLOCK and json.loads(value)[0] != json.loads(recorded[key])[0]:
                continue  # the edited script captures other objects at this block
            report.compared += 1  # only what is compared: a check of nothing is no pass
            report.lines += key[1].startswith(PRINTED)
            report.states += state
            if (recorded[key] != value) if state else differ(recorded[key], value):
                report.mismatches.append((*key, recorded[key], value))
    ran = {(b["block"], b["ctx"], b["occurrence"])
           for b in store.run_rows("blockruns", replay_id) if b["state"] in RAN}
    files = {rel: f.present for rel, f in plan.files.items()}
    present, reran = {}, {}  # per location, per context: rows share them by the thousand
    for key, value in recorded.items():
        loc, name, ctx, seq = key
        if key in replayed or name in (STATE_RANDOM, STATE_ENTRY):
            continue  # (an epoch's: not where a replay segment starts)
        if loc not in present:
            present[loc] = _present(loc, files)
        if not present[loc]:
            continue
        if ctx not in reran:
            reran[ctx] = all(b in ran for b in enclosing_blocks(ctx))
        if reran[ctx] and tolerance > 0 and name == STATE_ITERATION:
            report.states_skipped += 1  # a replay under --tolerance takes none
        elif reran[ctx]:
            report.missing.append((*key, value))
    report.boundaries = _boundaries(store, replay_id)
    return report


def _boundaries(store, replay_id) -> list[str]:
    """What the starts of the replay's segments did not verify: a segment
    whose iteration checkpoint put back state unlike the record's ran again
    from its start; one that restored what it could not verify says so."""
    run = store.run(replay_id)
    restarted = run["info"].restarted if run is not None else {}
    out = [f"segment {part} ran again from its start, without its iteration checkpoint: {why}"
           for part, why in sorted(restarted.items(), key=lambda kv: int(kv[0]))]
    for p in store.parts(replay_id):
        unverified = p["info"].unverified
        if unverified:
            out.append(f"segment {p['part']} started from an iteration checkpoint and could "
                       f"not verify what it restored of {'; '.join(unverified)}")
    return out
