"""python -m flor replay: plan the replay of a recorded run, run it, assemble it.

    plan = what changed in the program (probed blocks, line maps), the
           recorded checkpoints, and the main loop's iterations split into
           contiguous segments whose boundaries fall just after checkpointed
           iterations, balanced by the times the record measured
    run  = one worker process per segment (--jobs N), or one segment in this
           process (--part I/N, for schedulers that run the parts elsewhere;
           each part writes a database of its own, which merge imports)
    merge= stdout and stderr in iteration order, deferred checks, timings
"""
from __future__ import annotations

import hashlib
import json
import os
import runpy
import select
import shutil
import subprocess
import sys
import time
import traceback

from .checks import compare_logs, explain, merged_output
from .handsfree import run_script
from .instrument import instrument
from .probe import detect
from .session import Session, SegmentDone
from .source import compare_program
from .store import Store, new_run_id

__all__ = ["FlorError", "plan_replay", "partition", "run_local", "run_part", "merge"]


class FlorError(Exception):
    """A user-facing error of the flor command line."""


def partition(total: int, jobs: int, resumable: set, work=None, pseudo=None) -> list[list[int]]:
    """Split iterations [0, total) into at most `jobs` contiguous segments, each
    starting just after a resumable iteration (one whose block executions were
    all checkpointed), so that the busiest worker finishes soonest.

    A worker first pseudoresumes the iterations before its segment, at
    pseudo[i] seconds each, then replays its own at work[i] each.  Without
    costs every iteration counts 1 and pseudoresume 0: equal-length segments.
    """
    if total <= 0:
        return [[0, 0]]
    work = list(work) if work is not None else [1.0] * total
    pseudo = list(pseudo) if pseudo is not None else [0.0] * total
    starts = sorted(i + 1 for i in resumable if 0 <= i < total - 1)
    pw, pp = [0.0], [0.0]
    for w, p in zip(work, pseudo):
        pw.append(pw[-1] + w)
        pp.append(pp[-1] + p)

    def cost(s, e):
        return pp[s] + pw[e] - pw[s]

    def greedy(limit):
        """Segment starts if every worker can finish within `limit`, else None."""
        bounds = [0]
        while cost(bounds[-1], total) > limit:
            s = bounds[-1]
            reach = [c for c in starts if c > s and cost(s, c) <= limit]
            if not reach or len(bounds) == jobs:
                return None
            bounds.append(reach[-1])
        return bounds

    lo, hi = 0.0, cost(0, total)
    best = [0]
    for _ in range(60):  # bisect the busiest worker's time
        mid = (lo + hi) / 2
        found = greedy(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    best = greedy(hi) or best
    return [[b, e] for b, e in zip(best, best[1:] + [total])]


def _main_iteration(row, main_top):
    return row["top_iter"] if row["top"] == main_top else None


def _outermost(row):
    """A block execution not nested in another block's (whose time includes it)."""
    return not any(frame[0] == "B" for frame in json.loads(row["ctx"]))


def iteration_costs(rec, decisions, loops, probed, no_restore):
    """Seconds per main-loop iteration when replayed (probed blocks run, the
    others are restored) and when pseudoresumed, from what the record measured."""
    total = rec["iterations"] or 0
    main_top = json.dumps([rec["main_loop"], rec["main_run"]], separators=(",", ":"))
    loop = [r for r in loops if (r["loop"], r["run"], r["depth"]) ==
            (rec["main_loop"], rec["main_run"], 0)]
    block_time, run_time, pseudo_time = [0.0] * total, [0.0] * total, [0.0] * total
    for d in decisions:
        i = _main_iteration(d, main_top)
        if i is None or not 0 <= i < total or not _outermost(d):
            continue
        block_time[i] += d["compute_s"]
        restorable = d["checkpoint"] and d["block"] not in no_restore
        restore = (rec["c"] or 0.0) * (d["materialize_s"] or 0.0)
        run_time[i] += d["compute_s"] if d["block"] in probed or not restorable else restore
        pseudo_time[i] += restore if restorable else d["compute_s"]
    outer = max(0.0, (loop[0]["seconds"] - sum(block_time)) / total) if loop and total else 0.0
    return [outer + t for t in run_time], [outer + t for t in pseudo_time]


def plan_replay(store: Store, script: str, args, jobs: int, run_id=None, part=None):
    if not os.path.isfile(script):
        raise FlorError(f"no such script: {script}")
    if run_id is not None:
        rec = store.run(run_id)
        if rec is None or rec["kind"] != "record":
            raise FlorError(f"no recorded run {run_id!r} in {store.root}; "
                            "`python -m flor runs` lists them")
    else:
        records = store.records(script)
        rec = next((r for r in records if r["status"] == "finished"), None)
        if rec is None:
            raise FlorError(f"no recorded run of {os.path.basename(script)} in {store.root}; "
                            f"record it first: python -m flor record {script}")
        if records[0] is not rec:
            print(f"flor: the latest record of {os.path.basename(script)}, run "
                  f"{records[0]['run_id']}, {records[0]['status']}; replaying run "
                  f"{rec['run_id']}", file=sys.stderr)
    recorded = store.module_sources(rec["run_id"])
    if None not in recorded:
        raise FlorError(f"the source of run {rec['run_id']} is missing from {store.root}")
    base = os.path.dirname(os.path.abspath(script))
    old, new = {}, {}
    for rel, text in recorded.items():
        rel = rel or os.path.basename(script)
        path = os.path.join(base, rel)
        old[rel] = text
        if os.path.isfile(path):
            with open(path) as f:
                new[rel] = f.read()
    cmp = compare_program(old, new)
    hands_free = None
    if json.loads(rec["info"] or "{}").get("hands_free"):
        rel = os.path.basename(script)
        files = {rel: {"lines": cmp.files[rel].lines}} if rel in cmp.files else {}
        inst = instrument_current(new[rel], script, {"files": files})
        probe = detect(old[rel], new[rel], inst)
        cmp.probed, cmp.changed_end = probe.probed, set()
        hands_free = {"hindsight": probe.hindsight, "other": probe.other,
                      "blocks": inst.summary()["blocks"]}
    decisions = store.rows("decisions", rec["run_id"])
    loops = store.rows("loops", rec["run_id"])
    main_top = json.dumps([rec["main_loop"], rec["main_run"]], separators=(",", ":"))
    total = rec["iterations"] or 0
    restorable: dict = {}
    for d in decisions:
        if _outermost(d):
            ok = bool(d["checkpoint"]) and d["block"] not in cmp.changed_end
            restorable.setdefault(_main_iteration(d, main_top), []).append(ok)
    resumable = {i for i in range(total) if all(restorable.get(i, [True]))}
    work, pseudo = iteration_costs(rec, decisions, loops, cmp.probed, cmp.changed_end)
    segments = partition(total, jobs, resumable, work, pseudo)
    if part is not None:
        # Parts run on other machines must agree on one replay id.
        digest = hashlib.sha1(json.dumps(
            [sorted(new.items()), list(args), jobs, rec["run_id"]]).encode()).hexdigest()[:10]
        replay_id = f"{rec['run_id']}-r{digest}"
    else:
        replay_id = new_run_id()
    plan = {
        "store": store.root, "script": os.path.abspath(script),
        "argv": [script, *args], "record": rec["run_id"], "replay_id": replay_id,
        "segments": segments, "probed": sorted(cmp.probed),
        "changed_end": sorted(cmp.changed_end),
        "files": {rel: {"lines": {str(k): v for k, v in f.lines.items()},
                        "sites": {str(k): v for k, v in f.sites.items()},
                        "present": sorted(f.present)} for rel, f in cmp.files.items()},
        "checkpoints": [[d["block"], d["ctx"], d["occurrence"], d["file"]]
                        for d in decisions if d["checkpoint"] and d["file"]],
        "ckpt_dir": store.ckpt_dir(rec["run_id"]), "main_loop": rec["main_loop"],
        "main_run": rec["main_run"], "iterations": total,
        "epsilon": rec["epsilon"], "c": rec["c"], "hands_free": hands_free,
    }
    return plan, rec, cmp, new[os.path.basename(script)]


def _begin(store, plan, rec, source, nparts, mode):
    """Create the replay run and write its plan next to it."""
    if store.run(plan["replay_id"]) is None:
        store.new_run("replay", plan["script"], plan["argv"][1:], source, parent=rec["run_id"],
                      run_id=plan["replay_id"], main_loop=plan["main_loop"],
                      main_run=plan["main_run"], iterations=plan["iterations"],
                      info=json.dumps({"nparts": nparts, "mode": mode,
                                       "segments": plan["segments"],
                                       "probed": plan["probed"]}))
    path = os.path.join(store.run_dir(plan["replay_id"]), "plan.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def _describe(plan, rec, cmp, args, recorded_argv):
    notes = []
    hf = plan.get("hands_free")
    if hf is not None and not hf["blocks"]:
        notes.append("the script has no SkipBlock (no loop nested in a loop, no call of a "
                     "looping function of the script): replay re-executes all of it")
    elif cmp.probed:
        notes.append("stepping into changed blocks: " + ", ".join(sorted(cmp.probed)))
    else:
        notes.append("no block changed: every block is skipped")
    if cmp.changed_end:
        notes.append("end() changed for: " + ", ".join(sorted(cmp.changed_end)) +
                     " (their checkpoints are not used)")
    if cmp.changed_functions:
        notes.append("changed functions: " + ", ".join(sorted(cmp.changed_functions)))
    if hf is not None:
        for line, text in hf["hindsight"]:
            notes.append(f"hindsight statement at line {line}: {text}")
        if hf["other"]:
            notes.append("WARNING: the script changed in ways other than hindsight "
                         "statements (their blocks are re-executed; --strict refuses):\n" +
                         "\n".join(f"    line {line}: {text}" for line, text in hf["other"]))
    if list(args) != recorded_argv[1:]:
        notes.append(f"arguments differ from the record's {recorded_argv[1:]}")
    segs = ", ".join(f"[{s}, {e})" for s, e in plan["segments"])
    notes.append(f"replaying run {rec['run_id']}: {plan['iterations']} iterations "
                 f"in segments {segs}")
    return notes


def part_db(store, replay_id, part):
    return os.path.join(store.run_dir(replay_id), f"part-{part}.db")


def run_main(script, stderr, inst=None):
    """Run `script` as ``__main__`` the way ``python script`` would (its
    instrumented code `inst` in hands-free mode), and return (exit status,
    the exception that ended it or None).  A traceback, or the message of
    ``sys.exit("...")``, goes to `stderr` as Python would print it."""
    try:
        if inst is not None:
            run_script(script, inst)
        else:
            runpy.run_path(script, run_name="__main__")
    except SegmentDone:
        return 0, None
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=stderr)
            code = 1
        return code, (e if code else None)
    except BaseException as e:  # the script failed: report it as Python would
        traceback.print_exc(file=stderr)
        return 1, e
    return 0, None


def instrument_current(source, script, plan):
    """Instrument the current script of a hands-free replay, naming each loop
    and block by its line in the recorded script (``file:new:N`` if new)."""
    rel = os.path.basename(script)
    lines = plan["files"].get(rel, {}).get("lines", {})

    def key_of(line):
        old = lines.get(str(line), lines.get(line))
        return f"{rel}:{old}" if old is not None else f"{rel}:new:{line}"
    return instrument(source, os.path.abspath(script), key_of)


def run_part(plan: dict, part: int, tee=False, own_db=False) -> int:
    """Run one segment of the plan in this process (a worker, or --part)."""
    plan = dict(plan, tee=tee)
    store = Store(plan["store"])
    if own_db:
        store = Store(plan["store"], db_file=part_db(store, plan["replay_id"], part))
    session = Session.replay(plan, part, store=store)
    script = plan["script"]
    sys.argv = list(plan["argv"])
    sys.path[0] = os.path.dirname(script)
    inst = None
    if plan.get("hands_free"):
        with open(script) as f:
            inst = instrument_current(f.read(), script, plan)
    error, code = None, 0
    try:
        code, error = run_main(script, sys.__stderr__, inst)
    finally:
        session.finish(error)
    return code


class _Progress:
    def __init__(self, total, parts):
        self.total, self.parts, self.done = total, parts, 0
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def step(self, n=1):
        self.done += n
        self.show()

    def show(self, final=False):
        pct = int(100 * self.done / self.total) if self.total else 100
        if self.tty:
            width = 30
            fill = int(width * self.done / self.total) if self.total else width
            sys.stderr.write(f"\rreplay [{'#' * fill}{'.' * (width - fill)}] "
                             f"{self.done}/{self.total} iterations, {self.parts} workers")
            if final:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif final or pct // 25 > self.shown:
            self.shown = pct // 25
            print(f"replay: {self.done}/{self.total} iterations", file=sys.stderr, flush=True)


def _gpus():
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(l for l in out.splitlines() if l.startswith("GPU"))]


def run_local(store, plan, rec, cmp, source, args, strict=False) -> int:
    nparts = len(plan["segments"])
    t0 = time.time()
    for note in _describe(plan, rec, cmp, args, json.loads(rec["argv"])):
        print(f"flor: {note}", file=sys.stderr)
    r, w = os.pipe()
    plan = dict(plan, progress_fd=w)
    plan_path = _begin(store, plan, rec, source, nparts, "local")
    threads = str(max(1, (os.cpu_count() or 1) // nparts))
    gpus = _gpus()
    procs, logs = [], []
    for p in range(nparts):
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[p % len(gpus)]
        err = open(os.path.join(store.run_dir(plan["replay_id"]), f"part{p}.stderr"), "w+")
        logs.append(err)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flor", "_worker", plan_path, str(p)],
            env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err, pass_fds=(w,)))
    os.close(w)
    progress = _Progress(sum(e - s for s, e in plan["segments"]), nparts)
    progress.show()
    buf = b""
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], 1.0)
            if ready:
                chunk = pipe.read(4096)
                if not chunk:
                    break  # every worker has exited
                buf += chunk
                *lines, buf = buf.split(b"\n")
                progress.step(len(lines))
    codes = [proc.wait() for proc in procs]
    progress.show(final=True)
    failed = [p for p, c in enumerate(codes) if c != 0]
    for p, err in enumerate(logs):
        err.seek(0)
        text = err.read()
        err.close()
        if text.strip():
            print(f"--- replay worker {p} ---\n{text.rstrip()}", file=sys.stderr)
    if failed:
        store.update_run(plan["replay_id"], finished=time.time(), status="failed")
        print(f"flor: replay failed in worker{'s' if len(failed) > 1 else ''} "
              f"{', '.join(map(str, failed))}", file=sys.stderr)
        return 1
    return _conclude(store, plan, rec, time.time() - t0, strict)


def _conclude(store, plan, rec, seconds, strict) -> int:
    replay_id = plan["replay_id"]
    out, err = merged_output(store, replay_id)
    sys.stdout.write(out)
    sys.stdout.flush()
    sys.stderr.write(err)
    report = compare_logs(store, rec["run_id"], replay_id, plan,
                          tolerance=plan.get("tolerance") or 0.0)
    with open(plan["script"]) as f:
        explain(report, store, plan, f.read())
    recorded = (rec["finished"] or 0) - (rec["started"] or 0)
    info = json.loads(store.run(replay_id)["info"] or "{}")
    info.update(checks_passed=report.passed, compared=report.compared,
                mismatches=len(report.mismatches), missing=len(report.missing),
                seconds=seconds)
    store.update_run(replay_id, finished=time.time(), status="finished", info=json.dumps(info))
    print(f"flor: {report.summary()}", file=sys.stderr)
    if not report.passed:
        rec_threads = json.loads(rec["info"] or "{}").get("threads")
        used = {json.loads(p["info"] or "{}").get("threads") for p in store.rows("parts", replay_id)}
        if rec_threads is not None and used - {rec_threads}:
            print(f"flor: likely cause: the record ran torch with {rec_threads} intra-op "
                  f"threads and the replay with {sorted(t for t in used if t)}; CPU results "
                  "match bit for bit only with the same thread count (set it in the script "
                  "with torch.set_num_threads)", file=sys.stderr)
    if recorded > 0 and seconds > 0:
        print(f"flor: replay {replay_id} took {seconds:.1f} s; the recorded run took "
              f"{recorded:.1f} s ({recorded / seconds:.1f}x)", file=sys.stderr)
    return 1 if strict and not report.passed else 0


def merge(store, replay_id=None, strict=False) -> int:
    """Assemble a replay whose parts ran separately (--part I/N)."""
    runs_dir = os.path.join(store.root, "runs")
    if replay_id is None:
        candidates = sorted((os.path.getmtime(os.path.join(runs_dir, d, "plan.json")), d)
                            for d in os.listdir(runs_dir) if os.path.isfile(
                                os.path.join(runs_dir, d, "plan.json"))) \
            if os.path.isdir(runs_dir) else []
        if not candidates:
            raise FlorError(f"no replay to merge in {store.root}")
        replay_id = candidates[-1][1]
    plan_path = os.path.join(store.run_dir(replay_id), "plan.json")
    if not os.path.isfile(plan_path):
        raise FlorError(f"no replay {replay_id!r} in {store.root}")
    with open(plan_path) as f:
        plan = json.load(f)
    nparts = len(plan["segments"])
    dbs = [part_db(store, replay_id, p) for p in range(nparts)]
    missing = [p for p, db in enumerate(dbs) if not os.path.isfile(db)]
    if missing:
        raise FlorError(f"replay {replay_id}: parts {missing} of {nparts} have not run; "
                        f"run them with --part I/{nparts}")
    for db in dbs:
        store.import_part(db)
    parts = {p["part"]: p for p in store.rows("parts", replay_id)}
    unfinished = [p for p in range(nparts) if parts.get(p, {}).get("status") != "finished"]
    if unfinished:
        raise FlorError(f"replay {replay_id}: parts {unfinished} of {nparts} did not finish")
    rec = store.run(plan["record"])
    with open(plan["script"]) as f:
        source = f.read()
    _begin(store, plan, rec, source, nparts, "parts")
    seconds = max(p["seconds"] or 0 for p in parts.values())
    return _conclude(store, plan, rec, seconds, strict)
