"""``python -m flor record --resume``: continue an interrupted record (or,
with ``--force``, a failed one once its script is fixed).

A record that was killed (or evicted: SIGTERM, Ctrl-C) stays in the store as an
interrupted run, with everything committed up to its last finished
main-loop iteration.  Resuming runs the script again in the same run: the
code before the main loop runs without storing anything (it was stored),
the main loop draws its items up to the last iteration checkpoint and
restores it (verified by its fingerprint), and recording goes on from the
next iteration; what the killed process stored after that checkpoint is
deleted first.  Without a usable iteration checkpoint the run is recorded
again from its start.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..context import top_key
from ..errors import FlorError, note
from ..layout import checkpoint_path
from .blockstate import UNREADABLE, belongs, expected, read_own, tag, tag_run

__all__ = ["ResumePoint", "find"]


@dataclass
class ResumePoint:
    run_id: str
    start: int  # the first main-loop iteration to record again (0: all of it)
    file: str | None  # the iteration checkpoint of iteration start - 1
    loop: str | None
    loop_run: int | None
    ord: int  # the run's order counter at that checkpoint
    decisions: int  # rowid of its decision: later decisions are deleted


def _differs(old: str, new: str) -> str:
    for i, (a, b) in enumerate(zip(old.splitlines() + [None], new.splitlines() + [None]), 1):
        if a != b:
            return f"line {i}"
    return "its end"


def find(store, script, args, force=False) -> ResumePoint:
    """The resume point of the latest interrupted record of `script`, after
    checking that the script and its arguments are the ones it recorded;
    with `force`, of its latest record if that one failed (the script
    raised: it goes on from its last iteration checkpoint before the failure,
    once the script is fixed)."""
    name = os.path.basename(script)
    records = store.records(script) if store.exists() else []
    runs = [r for r in records if store.status(r) == "interrupted"]
    if not runs and records and store.status(records[0]) == "failed":
        rid = records[0]["run_id"]
        if not force:
            raise FlorError(
                f"the latest record of {name}, run {rid}, failed ({records[0]['info'].error}); "
                f"once the script is fixed, `python -m flor record --resume --force {script}` "
                "continues it from its last iteration checkpoint before the failure")
        note(f"run {rid} failed ({records[0]['info'].error}); resuming it (--force)")
        runs = records[:1]
    if not runs:
        raise FlorError(f"no interrupted record of {name} in {store.root} (`flor runs` "
                        f"lists the runs); start one with: flor record {script}")
    run = runs[0]
    rid = run["run_id"]
    with open(os.path.join(store.layout.run_dir(rid), "source.py")) as f:
        recorded = f.read()
    with open(script) as f:
        current = f.read()
    if recorded != current:
        msg = (f"{name} changed since run {rid} recorded it (first at {_differs(recorded, current)})"
               "; resuming would mix two programs in one run")
        if not force:
            raise FlorError(msg + ". Restore the script, record it anew, or pass --force")
        note(msg + " (--force)")
    argv = run["argv"][1:]
    if args is not None and argv != list(args):
        msg = f"run {rid} recorded {name} with arguments {argv}, not {list(args)}"
        if not force:
            raise FlorError(msg + ". Pass the same arguments, or --force")
        note(msg + " (--force)")
    return _point(store, run)


def _point(store, run) -> ResumePoint:
    rid = run["run_id"]
    main = top_key(run["main_loop"], run["main_run"])
    for row in reversed(store.iteration_checkpoints(rid)):
        if row["top"] != main or row["top_iter"] >= (run["iterations"] or 0):
            continue
        try:
            path = checkpoint_path(store.layout.ckpt_dir(rid), row["file"])
            saved, _ = read_own(path, expected(tag(row["block"], row["ctx"], 0),
                                               tag_run(rid, run["info"])), devices=False)
        except UNREADABLE as e:
            note(f"iteration checkpoint {row['file']} cannot be used ({e}); trying an earlier one")
            continue
        if not belongs(saved, row["block"], row["ctx"], 0):
            continue
        return ResumePoint(rid, row["top_iter"] + 1, row["file"], run["main_loop"],
                           run["main_run"], saved["ord"], row["rowid_"])
    note(f"run {rid} has no iteration checkpoint to resume from; recording it again from "
         "its start")
    return ResumePoint(rid, 0, None, run["main_loop"], run["main_run"], 0, 0)
