"""Hindsight over many past runs: ``flor replay --runs all|ID,...|FILTER``.

The statements the user added to the script are applied to every chosen
record of it.  Each record is replayed as ``flor replay --run ID`` would
(partly, by its checkpoints, in parallel workers), with its own recorded
arguments, and with its own recorded version of the script: where that
version is not the one the user edited, the added lines are carried onto
it (flor/program/transplant.py), and a record they cannot be carried onto
is skipped with the reason.  The version the user edited is the newest
record's source that the script only adds lines to, else the one it
differs least from (transplant.base_of).  The replays' values
are named alike (flor/statements.py), so that one ``flor.dataframe`` holds
them all beside each run's arguments.

This module chooses the records and the text each one replays;
flor/__main__.py runs them one after another, on the local workers or on
one Ray cluster.
"""
from __future__ import annotations

import ast
import os
import re
from typing import NamedTuple

from ..errors import FlorError
from ..program.transplant import base_of, carry
from ..query import Query, QueryError, RunValues
from ..statements import printed_names

__all__ = ["Target", "choose", "targets"]


class Target(NamedTuple):
    """A chosen record: what its replay runs (`source`: None for the
    script file as edited; else its version with the added lines), or why
    it is skipped (`skipped`)."""

    record: dict
    source: str | None = None
    carried: int = 0  # lines added to its version
    skipped: str | None = None
    names: dict = {}  # {line of source: its statement's name in the script edited}


def _replayable(store, run) -> bool:
    return run["status"] == "finished" or (store.status(run) == "interrupted"
                                           and bool(run["iterations"]))


def choose(store, script: str, spec: str) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(records of `script` that `spec` chooses, oldest first; [(record,
    why it cannot be replayed)]).  `spec` is ``all``, run ids (or names,
    unique starts of ids, ``latest``) separated by commas or spaces, or a
    filter of the records' parameters and values (docs/results.md,
    Queries)."""
    name = os.path.basename(script)
    records = list(reversed(store.records(script)))  # oldest first
    if not records:
        raise FlorError(f"no recorded run of {name} in {store.root}; record it first "
                        f"(flor record {script})")
    spec = spec.strip()
    if not spec.strip(", "):
        raise FlorError("--runs needs `all`, run ids or names, or a filter (docs/results.md, "
                        "Hindsight over many runs)")
    if spec == "all":
        chosen = records
    else:
        try:
            chosen, ambiguous = _by_id(store, script, spec), None
        except _Ambiguous as e:  # (a filter may start with a number)
            chosen, ambiguous = None, e.error
        if chosen is None:
            try:
                query = Query(spec)
            except QueryError as e:
                if ambiguous is not None:
                    raise ambiguous from None
                raise FlorError(f"--runs {spec!r} is neither run ids or names of records of "
                                f"{name} nor a filter: {e}") from None
            chosen = [r for r in records if query.matches(RunValues(store, r))]
            if not chosen:
                raise FlorError(f"no record of {name} matches --runs {spec!r}; `flor runs "
                                f"--script {name} --kind record --where {spec!r}` shows "
                                "which runs match")
    ok = [r for r in chosen if _replayable(store, r)]
    out = [(r, f"it is {store.status(r)}" + (" (it ended before its main loop)"
                                             if r["status"] == "empty" else ""))
           for r in chosen if not _replayable(store, r)]
    return ok, out


class _Ambiguous(Exception):
    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


def _by_id(store, script, spec):
    """The records `spec` names one by one, in its order, or None where a
    word of it names no run."""
    words = [w for w in re.split(r"[,\s]+", spec) if w]
    out = []
    for word in words:
        try:
            row = store.run(store.resolve(word, "record", script))
        except FlorError as e:  # the start of several ids
            raise _Ambiguous(e) from None
        if row is None:
            return None
        if row["kind"] != "record":
            raise FlorError(f"--runs: run {row['run_id']} is a replay; name the records to "
                            f"replay (its record is {row['parent']})")
        if row["script_name"] != os.path.basename(script):
            raise FlorError(f"--runs: run {row['run_id']} is a record of "
                            f"{row['script_name']}, not of {os.path.basename(script)}")
        if all(r["run_id"] != row["run_id"] for r in out):
            out.append(row)
    return out


def targets(store, script: str, records: list[dict]) -> tuple[list[Target], str | None]:
    """(what each record replays, the id of the record whose version the
    script was edited from)."""
    with open(script) as f:
        new = f.read()
    name = os.path.basename(script)
    versions = {}
    for r in store.records(script):
        text = store.layout.module_sources(r["run_id"]).get(None)
        if text is not None:
            versions[r["run_id"]] = text
    base_id = base_of(new, versions)
    try:
        edited = printed_names(ast.parse(new), name)
    except SyntaxError:
        edited = {}
    out = []
    for rec in records:
        text = versions.get(rec["run_id"])
        if text is None:
            out.append(Target(rec, skipped=f"its source is missing from {store.root}"))
        elif base_id is None or text == versions[base_id]:
            out.append(Target(rec))  # the version edited: the script as it is
        else:
            got = carry(versions[base_id], new, text, name)
            names = {line: edited[at] for line, at in got.at.items() if at in edited}
            out.append(Target(rec, got.text, got.lines, names=names) if got.text is not None
                       else Target(rec, skipped=got.why))
    return out, base_id
