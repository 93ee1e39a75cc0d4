"""Managing the runs of a store: ``flor runs``, ``flor show``, ``flor rm``
and ``flor prune``.

A run is its rows in flor.db and its directory ``.flor/runs/<run>/``.
Deleting one deletes both, rows first (in one transaction), so that an
interrupted delete leaves at worst a directory that no row names, never a
row whose files are gone.  Deleting a record deletes its replays and, for a
data-parallel record, the runs of its other ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

from .context import STATE
from .errors import FlorError
from .query import RunValues
from .recorded import main_loop_checkpoints
from .store import Store

__all__ = ["STATUSES", "listing", "print_runs", "show", "remove", "prune", "check_name",
           "check_tags", "label"]

STATUSES = ("finished", "failed", "interrupted", "running", "empty")


def seconds(run) -> float | None:
    """How long a run took: a replay's own measure (a merged replay's parts
    ran before the run row was made), else finished - started."""
    if run["kind"] == "replay" and run["info"].seconds is not None:
        return float(run["info"].seconds)
    if run["finished"] and run["started"]:
        return run["finished"] - run["started"]
    return None


def listing(store: Store, script=None, status=None, kind=None, where=None,
            sort=None) -> list[dict]:
    """The runs of the store, oldest first, as plain dicts for display and
    JSON: filtered by script (path or file name), status, kind and `where`
    (a query.Query), in the order of `sort` (a query.SortKey) if given."""
    ckpts = store.checkpoint_counts()
    out = []
    chosen, statuses = [], {}
    for r in store.runs():
        st = statuses[r["run_id"]] = store.status(r)
        if script is not None and script not in (r["script"], r["script_name"]) \
                and os.path.basename(script) != r["script_name"]:
            continue
        if (status is not None and st != status) or (kind is not None and r["kind"] != kind):
            continue
        rv = RunValues(store, r)  # (read when a query asks: last, it reads values)
        if where is None or where.matches(rv):
            chosen.append(rv)
    for rv in (chosen if sort is None else sort.sort(chosen)):
        r = rv.run
        st = statuses[r["run_id"]]
        info, argv = r["info"], r["argv"]
        if argv and (r["kind"] == "record" or os.path.basename(argv[0]) == r["script_name"]):
            argv = argv[1:]  # (replays of older stores kept their arguments alone)
        row = {"run": r["run_id"], "kind": r["kind"], "script": r["script_name"],
               "args": argv, "status": st,
               "started": r["started"], "seconds": seconds(r),
               "iterations": r["iterations"] or 0, "checkpoints": ckpts.get(r["run_id"], 0),
               "parent": r["parent"]}
        if r["kind"] == "record" and info.world_size:
            row["rank"], row["world_size"] = info.rank or 0, info.world_size
            row["group"] = info.group
        if r["kind"] == "replay" and info.checks_passed is not None:
            row["checks_passed"] = info.checks_passed
        if r["kind"] == "replay" and info.rerun_seconds:
            row["rerun_seconds"] = info.rerun_seconds
        for key, value in (("name", info.name), ("tags", info.labels), ("note", info.note)):
            if value:
                row[key] = value
        out.append(row)
    return out


def print_runs(rows) -> None:
    """A table of `rows` (from listing), its columns as wide as their values;
    a column of names and tags where a run has them."""
    named = any(r.get("name") or r.get("tags") for r in rows)
    table = [("run", *(("name",) if named else ()), "kind", "script", "started", "seconds",
              "iters", "ckpts", "status")]
    for r in rows:
        secs = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        if r.get("rerun_seconds") and r["seconds"]:  # a replay, against re-running
            secs += f" ({r['rerun_seconds'] / r['seconds']:.1f}x)"
        status = r["status"]
        if r["parent"]:
            status += f" (of {r['parent']})"
        if "world_size" in r:
            status += (f" (rank {r['rank']} of {r['group']})" if r["rank"]
                       else f" ({r['world_size']} ranks)")
        if r.get("checks_passed") is False:
            status += ", checks failed"
        name = " ".join([r.get("name") or "-"] + [f"#{t}" for t in r.get("tags", ())])
        table.append((r["run"], *((name,) if named else ()), r["kind"], r["script"] or "-",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started"] or 0)),
                      secs, str(r["iterations"]), str(r["checkpoints"]), status))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    right = {5, 6, 7} if named else {4, 5, 6}
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells + [row[-1]]))


def show(store: Store, run_id: str) -> dict:
    """Everything flor knows of one run, for ``flor show``."""
    run = _get(store, run_id)
    (row,) = [r for r in listing(store) if r["run"] == run["run_id"]] or [None]
    decisions = store.rows("decisions", run["run_id"])
    written = [d for d in decisions if d["checkpoint"] and d["file"]]
    ckpt_dir = store.layout.ckpt_dir(run["run_id"])
    present = [d for d in written if os.path.exists(os.path.join(ckpt_dir, d["file"]))]
    out = dict(row or {}, argv=run["argv"], cwd=run["cwd"],
               script_path=run["script"], main_loop=run["main_loop"],
               versions=run["versions"], info=run["info"].to_dict(),
               directory=store.layout.run_dir(run["run_id"]),
               checkpoints_decided=len(written), checkpoints_missing=len(written) - len(present),
               checkpoint_bytes=sum(os.path.getsize(os.path.join(ckpt_dir, d["file"]))
                                    for d in present),
               replays=[r["run_id"] for r in store.runs() if r["parent"] == run["run_id"]],
               state_iterations=[r["top_iter"] for r in main_loop_checkpoints(store, run)]
               if run["kind"] == "record" else [],
               names=sorted({r["name"] for r in store.logs(run["run_id"])
                             if not r["name"].startswith(STATE)}))
    return out


def print_show(d: dict) -> None:
    keys = ("run", "name", "tags", "note", "kind", "script", "script_path", "argv", "cwd",
            "status", "started",
            "seconds", "iterations", "main_loop", "checkpoints", "checkpoints_missing",
            "checkpoint_bytes", "state_iterations", "parent", "replays", "checks_passed",
            "directory")
    for k in keys:
        if k not in d or d[k] in (None, [], "") or (d.get("kind") == "replay"
                                                  and k.startswith("checkpoint")):
            continue
        v = d[k]
        if k == "started":
            v = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v))
        elif k == "seconds":
            v = f"{v:.1f}"
        elif k == "checkpoint_bytes":
            v = f"{v / 2**20:.1f} MiB"
        elif k == "state_iterations":  # what flor.state reads back
            shown = v if len(v) <= 6 else [*v[:3], "...", *v[-2:]]
            v = " ".join(map(str, shown)) + f" ({len(v)}; flor.state reads them)"
        elif isinstance(v, list):
            v = " ".join(str(x) for x in v)
        print(f"{k + ':':20} {v}")
    config = d["info"].get("config")
    if config:
        print(f"{'config:':20} " + " ".join(
            f"{k}={json.dumps(v) if isinstance(v, str) and not v.isprintable() else v}"
            for k, v in config.items()))
    code = d["info"].get("code")
    if code:
        print(f"{'code:':20} {_code_line(code, d.get('directory'))}")
    error = d["info"].get("error")
    if error:
        print(f"{'error:':20} {error}")
    if d["names"]:
        print(f"{'logged:':20} " + ", ".join(d["names"]))


def _code_line(code: dict, directory) -> str:
    """A record's git version in one line: commit, branch, dirty or clean."""
    what = code["commit"][:12] if code.get("commit") else "no commit yet"
    if code.get("branch"):
        what += f" on {code['branch']}"
    what += f" in {code['root']}"
    if code.get("dirty"):
        what += ", with uncommitted changes"
        if code.get("diff") and directory:
            what += f" ({os.path.join(directory, code['diff'])})"
    if code.get("untracked"):
        what += f", {code['untracked']} untracked file{'s' if code['untracked'] != 1 else ''}"
    return what


# A run's name: a letter, then letters, digits, '.', '_' or '-' (a run id
# starts with a digit, so that no name is the start of one).
NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")


def check_name(store: Store, name: str, run_id: str | None = None) -> None:
    """Refuse a name that is not one, `latest`, or another run's name."""
    if not NAME.fullmatch(name) or name == "latest":
        raise FlorError(f"{name!r} cannot name a run: a name starts with a letter and holds "
                        "letters, digits, '.', '_' and '-' (at most 64), and is not 'latest'")
    if not store.exists():
        return
    for r in store.runs():
        if getattr(r["info"], "name", None) == name and r["run_id"] != run_id:
            raise FlorError(f"run {r['run_id']} is named {name!r} already; choose another "
                            f"name, or rename that run (flor tag {r['run_id']} --name NEW)")


def check_tags(tags) -> None:
    """Refuse a tag that is not one word."""
    for tag in tags:
        if not tag or any(c.isspace() for c in tag):
            raise FlorError(f"a tag is one word (no spaces), not {tag!r}")


def label(store: Store, run_id: str, name=None, add=(), remove=(), note=None) -> dict:
    """Name, tag or annotate run `run_id` (`note` "" removes its note);
    returns its run info's labels."""
    run = _get(store, run_id)
    info = run["info"]
    if name is not None:
        check_name(store, name, run["run_id"])
        info.name = name
    check_tags(add)
    if add or remove:
        info.labels = [t for t in dict.fromkeys([*info.labels, *add]) if t not in remove]
    if note is not None:
        info.note = note or None
    store.update_run(run["run_id"], info=info)
    return {"name": info.name, "tags": info.labels, "note": info.note}


def _get(store, run_id):
    run = store.run(run_id)
    if run is None:
        raise FlorError(f"no run {run_id!r} in {store.root}; `flor runs` lists them")
    return run


def _with_dependents(store, run_ids) -> list[str]:
    """The runs and what cannot outlive them: a record's replays and the
    runs of its other data-parallel ranks."""
    runs = store.runs()
    out, todo = [], list(run_ids)
    while todo:
        rid = todo.pop(0)
        if rid in out:
            continue
        out.append(rid)
        todo += [r["run_id"] for r in runs if r["parent"] == rid
                 or r["run_id"].startswith(rid + "-rank")]
    return out


def remove(store: Store, run_ids, dry_run=False) -> list[str]:
    """Delete runs (rows, then files), with their replays and other ranks.
    Refuses a record that is still running.  Returns the ids deleted."""
    for rid in run_ids:
        run = _get(store, rid)
        info = run["info"]
        if run["kind"] == "record" and info.follower:
            raise FlorError(f"run {rid} is rank {info.rank} of the data-parallel record "
                            f"{info.group}; delete that record (flor rm "
                            f"{info.group}) to delete all its ranks")
        if store.status(run) == "running" and run["kind"] == "record":
            raise FlorError(f"run {rid} is still running; stop it before deleting it")
    doomed = _with_dependents(store, run_ids)
    if dry_run:
        return doomed
    store.delete_runs(doomed)
    for rid in doomed:
        shutil.rmtree(store.layout.run_dir(rid), ignore_errors=True)
    return doomed


def prune(store: Store, keep: int, script=None, dry_run=False) -> list[str]:
    """Per script, keep the newest `keep` records that can be replayed
    (finished, or interrupted after committing an iteration) and delete the
    other records of that script (older ones, failed ones, empty ones) with
    their replays.  Returns the ids deleted."""
    if keep < 0:
        raise FlorError("--keep must be at least 0")
    by_script: dict = {}
    for r in reversed(store.runs()):  # newest first
        if r["kind"] != "record" or r["info"].follower:
            continue
        if script is not None and os.path.basename(script) != r["script_name"]:
            continue
        by_script.setdefault(r["script_name"], []).append(r)
    doomed = []
    for records in by_script.values():
        kept = 0
        for r in records:
            st = store.status(r)
            if st == "running":
                continue
            if kept < keep and (st == "finished" or (st == "interrupted" and r["iterations"])):
                kept += 1
                continue
            doomed.append(r["run_id"])
    return remove(store, doomed, dry_run) if doomed else []
