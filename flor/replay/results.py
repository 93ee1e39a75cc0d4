"""Assembling a replay: its output in iteration order, the deferred checks,
the timing; and ``merge``, which imports parts that ran elsewhere first.

Each worker stores the output and logs of the iterations it replayed; the
first part contributes what came before the main loop and the last part
what came after it (Store.run_rows).
"""
from __future__ import annotations

import os
import sys
import time

from ..context import MAIN, POST, PRE
from ..errors import FlorError, note
from ..store import Store
from .causes import explain
from .checks import compare_logs
from .estimate import closing_line, rerun_seconds
from .plan import Plan, register

__all__ = ["merged_output", "conclude", "merge"]


def merged_output(store: Store, run_id):
    """A replay's (stdout, stderr): before the main loop, its iterations in
    order, after it."""
    rows = store.run_rows("output", run_id)
    out = []
    for stream in ("stdout", "stderr"):
        mine = [r for r in rows if r["stream"] == stream]
        main = sorted((r for r in mine if r["phase"] == MAIN),
                      key=lambda r: (r["iter"] if r["iter"] is not None else -1, r["part"], r["ord"]))
        out.append("".join([r["text"] for r in mine if r["phase"] == PRE] +
                           [r["text"] for r in main] +
                           [r["text"] for r in mine if r["phase"] == POST]))
    return tuple(out)


def conclude(store: Store, plan: Plan, seconds, strict) -> int:
    """Print the replay's output, run the deferred checks, report; the exit
    status (1 if the checks failed and `strict`)."""
    replay_id = plan.replay_id
    out, err = merged_output(store, replay_id)
    sys.stdout.write(out)
    sys.stdout.flush()
    sys.stderr.write(err)
    rec = store.run(plan.record)
    report = compare_logs(store, rec["run_id"], replay_id, plan, tolerance=plan.tolerance or 0.0)
    explain(report, store, plan, plan.text(), rec)
    info = store.run(replay_id)["info"]
    info.checks_passed, info.compared = report.passed, report.compared
    info.mismatches, info.missing = len(report.mismatches), len(report.missing)
    info.seconds, info.rerun_seconds = seconds, rerun_seconds(rec)
    store.update_run(replay_id, finished=time.time(), status="finished", info=info)
    note(report.summary())
    for cause in report.run_causes:
        note(f"likely cause: {cause}")
    line = closing_line(replay_id, seconds, rec)
    if line:
        note(line)
    return 1 if strict and not report.passed else 0


def merge(store: Store, replay_id=None, strict=False) -> int:
    """Assemble a replay whose parts ran separately (--part I/N)."""
    if replay_id is None:  # the latest replay run in parts that is not merged yet
        pending = [r for r in store.layout.part_replays()
                   if (store.run(r) or {}).get("status") != "finished"]
        if not pending:
            raise FlorError(f"no replay run with --part waits to be merged in {store.root}; "
                            "name one: flor merge REPLAY (`flor runs` lists them)")
        replay_id = pending[0]
    plan_path = store.layout.plan_path(replay_id)
    if not os.path.isfile(plan_path):
        raise FlorError(f"no replay {replay_id!r} in {store.root}")
    plan = Plan.load(plan_path)
    nparts = len(plan.segments)
    dbs = [store.layout.part_db(replay_id, p) for p in range(nparts)]
    missing = [p for p, db in enumerate(dbs) if not os.path.isfile(db)]
    if missing:
        raise FlorError(f"replay {replay_id}: parts {missing} of {nparts} have not run; "
                        f"run them with --part I/{nparts}")
    for db in dbs:
        store.import_part(db)
    parts = {p["part"]: p for p in store.parts(replay_id)}
    unfinished = [p for p in range(nparts) if parts.get(p, {}).get("status") != "finished"]
    if unfinished:
        raise FlorError(f"replay {replay_id}: parts {unfinished} of {nparts} did not finish")
    register(store, plan, "parts")
    seconds = max(p["seconds"] or 0 for p in parts.values())
    return conclude(store, plan, seconds, strict)
