"""Deferred checks and the assembly of a replay's results.

A replay's workers each store the logs and output of the iterations they
replayed; the first part contributes what came before the main loop and the
last part what came after it.

The deferred check compares the replay's logged values with the record's.
A value is identified by its statement (file:line in recorded line numbers),
its context (the enclosing loops and block executions, see session.py) and
its count within that context.  Every value that both runs logged is
compared, and a value the record logged is reported missing when the replay
should have logged it too: its statement is still in the program and every
block execution around it ran again.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

__all__ = ["run_logs", "merged_output", "compare_logs", "CheckReport"]

RAN = ("step_into", "execute")


def _nparts(store, run_id):
    run = store.run(run_id)
    if run is None or run["kind"] != "replay":
        return None
    return json.loads(run["info"] or "{}").get("nparts", 1)


def _keep(row, nparts):
    """Which stored rows make up the run: replay parts repeat pre and post."""
    if nparts is None or row["phase"] == "main":
        return True
    if row["phase"] == "pre":
        return row["part"] == 0
    return row["part"] == nparts - 1


def _rows(store, table, run_id):
    nparts = _nparts(store, run_id)
    return [r for r in store.rows(table, run_id, "ORDER BY part, ord" if table != "blockruns"
                                  else "") if _keep(r, nparts)]


def run_logs(store, run_id):
    return _rows(store, "logs", run_id)


def merged_output(store, run_id):
    """A replay's (stdout, stderr): before the main loop, its iterations in
    order, after it."""
    rows = _rows(store, "output", run_id)
    out = []
    for stream in ("stdout", "stderr"):
        mine = [r for r in rows if r["stream"] == stream]
        main = sorted((r for r in mine if r["phase"] == "main"),
                      key=lambda r: (r["iter"] if r["iter"] is not None else -1, r["part"], r["ord"]))
        out.append("".join([r["text"] for r in mine if r["phase"] == "pre"] +
                           [r["text"] for r in main] +
                           [r["text"] for r in mine if r["phase"] == "post"]))
    return tuple(out)


@dataclass
class CheckReport:
    compared: int = 0
    mismatches: list = field(default_factory=list)  # (loc, name, ctx, seq, recorded, replayed)
    missing: list = field(default_factory=list)  # (loc, name, ctx, seq, recorded)
    ambiguous: int = 0

    @property
    def passed(self):
        return not self.mismatches and not self.missing

    def summary(self, limit=10) -> str:
        if self.passed:
            return (f"deferred checks passed: {self.compared} logged values of unchanged "
                    "statements equal the record's")
        lines = [f"deferred checks FAILED: of {self.compared + len(self.missing)} values the "
                 f"record logged, {len(self.mismatches)} differ and {len(self.missing)} were "
                 "not logged again:"]
        for loc, name, ctx, seq, rec, rep in self.mismatches[:limit]:
            lines.append(f"  {loc} {name!r} at {_where(ctx, seq)}: recorded {rec}, "
                         f"replayed {rep}")
        for loc, name, ctx, seq, rec in self.missing[:max(0, limit - len(self.mismatches))]:
            lines.append(f"  {loc} {name!r} at {_where(ctx, seq)}: recorded {rec}, "
                         "not logged by the replay")
        more = len(self.mismatches) + len(self.missing) - limit
        if more > 0:
            lines.append(f"  ... and {more} more")
        return "\n".join(lines)


def _where(ctx, seq):
    parts = []
    for frame in json.loads(ctx):
        parts.append(f"{frame[1]}[{frame[3]}]" if frame[0] == "L" else f"block {frame[1]}")
    return (" > ".join(parts) or "top level") + (f" #{seq}" if seq else "")


def _present(loc, files):
    rel, _, line = loc.rpartition(":")
    fmap = files.get(rel)
    return fmap is not None and line.isdigit() and int(line) in fmap


def compare_logs(store, record_id, replay_id, plan=None) -> CheckReport:
    if plan is None:
        with open(os.path.join(store.run_dir(replay_id), "plan.json")) as f:
            plan = json.load(f)
    report = CheckReport()
    recorded, seen_twice = {}, set()
    for r in store.rows("logs", record_id):
        key = (r["loc"], r["name"], r["ctx"], r["seq"])
        if key in recorded:
            seen_twice.add(key)
        recorded[key] = r["value"]
    for key in seen_twice:  # cannot tell which value is which: not compared
        del recorded[key]
    report.ambiguous = len(seen_twice)
    replayed = {}
    for r in run_logs(store, replay_id):
        replayed[(r["loc"], r["name"], r["ctx"], r["seq"])] = r["value"]
    for key, value in replayed.items():
        if key in recorded:
            report.compared += 1
            if recorded[key] != value:
                report.mismatches.append((*key, recorded[key], value))
    ran = {(b["block"], b["ctx"], b["occurrence"]) for b in _rows(store, "blockruns", replay_id)
           if b["state"] in RAN}
    files = {rel: set(f["present"]) for rel, f in plan["files"].items()}
    for key, value in recorded.items():
        loc, name, ctx, seq = key
        if key in replayed or not _present(loc, files):
            continue
        frames = json.loads(ctx)
        blocks_ran = all(
            (f[1], json.dumps(frames[:i], separators=(",", ":")), f[2]) in ran
            for i, f in enumerate(frames) if f[0] == "B")
        if blocks_ran:
            report.missing.append((*key, value))
    return report
