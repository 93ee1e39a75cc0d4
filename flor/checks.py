"""Deferred checks and the assembly of a replay's results.

A replay's workers each store the logs and stdout of the iterations they
replayed; the part that ran first contributes what came before the main loop
and the last part what came after it.  The deferred check compares every
logged value of a statement that exists in both the recorded and the
replayed source (the log locations are in recorded line numbers) with the
recorded value at the same iteration.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["run_logs", "merged_output", "compare_logs", "CheckReport"]


def _parts(store, run_id):
    run = store.run(run_id)
    if run is None or run["kind"] != "replay":
        return None
    info = json.loads(run["info"] or "{}")
    return info.get("nparts", 1)


def _keep(row, nparts):
    """Which stored rows make up the run (replay parts repeat pre and post)."""
    if nparts is None:
        return True
    if row["phase"] == "main":
        return True
    if row["phase"] == "pre":
        return row["part"] == 0
    return row["part"] == nparts - 1


def run_logs(store, run_id):
    nparts = _parts(store, run_id)
    return [r for r in store.rows("logs", run_id, "ORDER BY part, ord") if _keep(r, nparts)]


def merged_output(store, run_id) -> str:
    """A replay's stdout: before the main loop, its iterations in order, after it."""
    nparts = _parts(store, run_id) or 1
    rows = [r for r in store.rows("output", run_id, "ORDER BY part, ord") if _keep(r, nparts)]
    pre = [r["text"] for r in rows if r["phase"] == "pre"]
    main = [r["text"] for r in sorted((r for r in rows if r["phase"] == "main"),
                                      key=lambda r: (r["iter"], r["part"], r["ord"]))]
    post = [r["text"] for r in rows if r["phase"] == "post"]
    return "".join(pre + main + post)


@dataclass
class CheckReport:
    compared: int = 0
    mismatches: list = field(default_factory=list)  # (name, loc, iter, seq, recorded, replayed)

    @property
    def passed(self):
        return not self.mismatches

    def summary(self, limit=10) -> str:
        if self.passed:
            return (f"deferred checks passed: {self.compared} logged values of unchanged "
                    "statements equal the record's")
        lines = [f"deferred checks: {len(self.mismatches)} of {self.compared} logged values "
                 "differ from the record:"]
        for name, loc, it, seq, rec, rep in self.mismatches[:limit]:
            at = f"iteration {it}" + (f" #{seq}" if seq else "")
            lines.append(f"  {loc} {name!r} at {at}: recorded {rec}, replayed {rep}")
        if len(self.mismatches) > limit:
            lines.append(f"  ... and {len(self.mismatches) - limit} more")
        return "\n".join(lines)


def compare_logs(store, record_id, replay_id) -> CheckReport:
    recorded = {(r["name"], r["loc"], r["iter"], r["seq"]): r["value"]
                for r in store.rows("logs", record_id)}
    report = CheckReport()
    for r in run_logs(store, replay_id):
        key = (r["name"], r["loc"], r["iter"], r["seq"])
        if key not in recorded:
            continue  # a hindsight statement, or a value the record never logged
        report.compared += 1
        if recorded[key] != r["value"]:
            report.mismatches.append((r["name"], r["loc"], json.loads(r["iter"]), r["seq"],
                                      recorded[key], r["value"]))
    return report
