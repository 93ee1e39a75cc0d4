"""python -m flor replay: plan the replay of a recorded run, run it, assemble it.

    plan = what changed in the source (probed blocks, line map), the recorded
           checkpoints, and the main loop's iterations split into contiguous
           segments whose boundaries fall just after checkpointed iterations,
           balanced by the times the record measured
    run  = one worker process per segment (--jobs N), or one segment in this
           process (--part i/N, for schedulers that run the parts elsewhere)
    merge= stdout in iteration order, deferred checks, timings
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

from .checks import compare_logs, merged_output
from .session import Session, SegmentDone
from .source import compare
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


def iteration_costs(store, rec, probed):
    """Seconds per main-loop iteration when replayed (probed blocks run, the
    others are restored) and when pseudoresumed, from what the record measured."""
    total = rec["iterations"] or 0
    decisions = store.rows("decisions", rec["run_id"])
    loop = [r for r in store.rows("loops", rec["run_id"])
            if r["loop"] == rec["main_loop"] and r["depth"] == 0]
    block_time = [0.0] * total
    run_time = [0.0] * total
    restore_time = [0.0] * total
    for d in decisions:
        i = d["main_iter"]
        if i is None or not 0 <= i < total:
            continue
        block_time[i] += d["compute_s"]
        restore = (rec["c"] or 0.0) * (d["materialize_s"] or 0.0)
        if d["block"] in probed:
            run_time[i] += d["compute_s"]
        else:
            run_time[i] += restore if d["checkpoint"] else d["compute_s"]
        restore_time[i] += restore if d["checkpoint"] else d["compute_s"]
    outer = max(0.0, (loop[0]["seconds"] - sum(block_time)) / total) if loop and total else 0.0
    return [outer + t for t in run_time], [outer + t for t in restore_time]


def plan_replay(store: Store, script: str, args, jobs: int, run_id=None, part=None):
    if not os.path.exists(script):
        raise FlorError(f"no such script: {script}")
    if run_id is not None:
        rec = store.run(run_id)
        if rec is None or rec["kind"] != "record":
            raise FlorError(f"no recorded run {run_id!r} in {store.root}; "
                            "`python -m flor runs` lists them")
    else:
        rec = store.latest_record(script)
        if rec is None:
            raise FlorError(f"no recorded run of {os.path.basename(script)} in {store.root}; "
                            f"record it first: python -m flor record {script}")
    old = store.source(rec["run_id"])
    with open(script) as f:
        new = f.read()
    if old is None:
        raise FlorError(f"the source of run {rec['run_id']} is missing from {store.root}")
    cmp = compare(old, new, os.path.basename(script))
    decisions = store.rows("decisions", rec["run_id"])
    by_iter: dict = {}
    for d in decisions:
        by_iter.setdefault(d["main_iter"], []).append(bool(d["checkpoint"]))
    total = rec["iterations"] or 0
    resumable = {i for i in range(total) if all(by_iter.get(i, [True]))}
    work, pseudo = iteration_costs(store, rec, cmp.probed)
    segments = partition(total, jobs, resumable, work, pseudo)
    if part is not None:
        # Parts run on other machines must agree on one replay id.
        digest = hashlib.sha1(
            json.dumps([new, list(args), jobs, rec["run_id"]]).encode()).hexdigest()[:10]
        replay_id = f"{rec['run_id']}-r{digest}"
    else:
        replay_id = new_run_id()
    plan = {
        "store": store.root, "script": os.path.abspath(script),
        "argv": [script, *args], "record": rec["run_id"], "replay_id": replay_id,
        "segments": segments, "probed": sorted(cmp.probed),
        "lines": {str(k): v for k, v in cmp.lines.items()},
        "checkpoints": [[d["block"], d["iter"], d["occurrence"], d["file"]]
                        for d in decisions if d["checkpoint"] and d["file"]],
        "ckpt_dir": store.ckpt_dir(rec["run_id"]), "main_loop": rec["main_loop"],
        "iterations": total, "epsilon": rec["epsilon"], "c": rec["c"],
    }
    return plan, rec, cmp, new


def _begin(store, plan, rec, source, nparts, mode):
    if store.run(plan["replay_id"]) is None:
        store.new_run("replay", plan["script"], plan["argv"][1:], source, parent=rec["run_id"],
                      run_id=plan["replay_id"], main_loop=plan["main_loop"],
                      iterations=plan["iterations"],
                      info=json.dumps({"nparts": nparts, "mode": mode,
                                       "segments": plan["segments"],
                                       "probed": plan["probed"]}))
    path = os.path.join(store.run_dir(plan["replay_id"]), "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def _describe(plan, rec, cmp, args, recorded_argv):
    notes = []
    if cmp.probed:
        notes.append("stepping into changed blocks: " + ", ".join(sorted(cmp.probed)))
    else:
        notes.append("no block changed: every block is skipped")
    if cmp.changed_end:
        notes.append("end() changed for: " + ", ".join(sorted(cmp.changed_end)))
    if list(args) != recorded_argv[1:]:
        notes.append(f"arguments differ from the record's {recorded_argv[1:]}")
    segs = ", ".join(f"[{s}, {e})" for s, e in plan["segments"])
    notes.append(f"replaying run {rec['run_id']}: {plan['iterations']} iterations "
                 f"in segments {segs}")
    return notes


def run_part(plan: dict, part: int, tee=False) -> int:
    """Run one segment of the plan in this process (a worker, or --part)."""
    plan = dict(plan, tee=tee)
    store = Store(plan["store"])
    for table in ("logs", "output", "blocks", "loops"):
        with store.db:
            store.db.execute(f"DELETE FROM {table} WHERE run_id = ? AND part = ?",
                             (plan["replay_id"], part))
    session = Session.replay(plan, part)
    script = plan["script"]
    sys.argv = list(plan["argv"])
    sys.path[0] = os.path.dirname(script)
    error, code = None, 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SegmentDone:
        pass
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            error = e
    except BaseException as e:  # the script failed: report it as Python would
        traceback.print_exc()
        error, code = e, 1
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
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU"))]


def run_local(store, plan, rec, cmp, source, args) -> int:
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
        if text.strip() and (p in failed or not failed):
            print(f"--- replay worker {p} stderr ---\n{text.rstrip()}", file=sys.stderr)
    if failed:
        store.update_run(plan["replay_id"], finished=time.time(), status="failed")
        print(f"flor: replay failed in worker{'s' if len(failed) > 1 else ''} "
              f"{', '.join(map(str, failed))}", file=sys.stderr)
        return 1
    return _conclude(store, plan["replay_id"], rec, time.time() - t0)


def _conclude(store, replay_id, rec, seconds) -> int:
    sys.stdout.write(merged_output(store, replay_id))
    sys.stdout.flush()
    report = compare_logs(store, rec["run_id"], replay_id)
    recorded = (rec["finished"] or 0) - (rec["started"] or 0)
    info = json.loads(store.run(replay_id)["info"] or "{}")
    info.update(checks_passed=report.passed, compared=report.compared,
                mismatches=len(report.mismatches), seconds=seconds)
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
    return 0


def merge(store, replay_id=None) -> int:
    """Assemble a replay whose parts ran separately (--part i/N)."""
    if replay_id is None:
        runs = [r for r in store.runs() if r["kind"] == "replay"]
        if not runs:
            raise FlorError(f"no replay runs in {store.root}")
        replay_id = runs[-1]["run_id"]
    run = store.run(replay_id)
    if run is None or run["kind"] != "replay":
        raise FlorError(f"no replay run {replay_id!r} in {store.root}")
    nparts = json.loads(run["info"] or "{}").get("nparts", 1)
    parts = {p["part"]: p for p in store.rows("parts", replay_id)}
    missing = [p for p in range(nparts) if parts.get(p, {}).get("status") != "finished"]
    if missing:
        raise FlorError(f"replay {replay_id}: parts {missing} of {nparts} have not finished; "
                        f"run them with --part i/{nparts}")
    seconds = max(p["seconds"] or 0 for p in parts.values())
    return _conclude(store, replay_id, store.run(run["parent"]), seconds)
