"""Diagnostic (not a benchmark): where an epoch-loop probe replay spends the
time that the partial-replay ideal of benchmarks/run.py leaves out.

Runs one workload plainly, records it hands-free, adds run.py's epoch-loop
print, replays it with --jobs 1 (timed as a whole command), then runs that
replay's worker command once more on its own, with timestamps taken inside
it: at its first line, when flor's replay session starts, at exit (atexit,
after the script and the session have finished) and, from outside, when the
process is gone.  A bare `python -c "import torch"` is timed the
same way for reference.  One run of each step, not a benchmark.

    python benchmarks/profile_replay.py [--workload language] [--epochs 12]
    python benchmarks/profile_replay.py --workload finetune --no-adaptive
                                   # a checkpoint every epoch: what restoring costs

Writes benchmarks/results/profile-replay-WORKLOAD[-every].json and .md
(or --out).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, add_line, machine, open_store, write_report  # noqa: E402
from run import WORKLOADS, Workload  # noqa: E402

WRAP = r"""
import atexit, json, sys, time
t0 = time.perf_counter()
marks = {}
import flor.runtime.session as S
orig = S.Session.replay.__func__
def replay(cls, *a, **k):
    marks["session_start"] = time.perf_counter() - t0
    return orig(cls, *a, **k)
S.Session.replay = classmethod(replay)
def at_exit():
    marks["atexit"] = time.perf_counter() - t0
    print("MARKS " + json.dumps(marks), file=sys.__stderr__)
atexit.register(at_exit)
if len(sys.argv) > 1:
    import runpy
    sys.argv = ["flor", "_worker", sys.argv[1], "0"]
    runpy.run_module("flor", run_name="__main__", alter_sys=True)
else:
    import torch
"""


def timed(w, argv, env=None):
    """Run a command in the workload's directory (run.py's Workload.run):
    its wall time and the MARKS it printed, if any."""
    wall, proc = w.run(argv, env=env)
    marks = [json.loads(line[6:]) for line in proc.stderr.splitlines()
             if line.startswith("MARKS ")]
    return wall, (marks[0] if marks else {})


def prepare(workload, epochs):
    """run.py's Workload in a fresh directory, with its full arguments
    (--epochs replaced if given) and FLOR_DIR a store that already holds this
    machine's bandwidth calibration (as in run.py, here taken by a one-epoch
    record)."""
    w = Workload(workload, WORKLOADS[workload], False, tempfile.mkdtemp(prefix="flor-profile-"))
    w.args = list(w.args)
    if epochs is not None:
        w.args[w.args.index("--epochs") + 1] = str(epochs)
    short = list(w.args)
    short[short.index("--epochs") + 1] = "1"
    warm = w.fresh_store("warm")
    w.run([sys.executable, "-m", "flor", "record", w.script, *short], env={"FLOR_DIR": warm})
    w.calibration = os.path.join(warm, "calibration.json")
    w.env["FLOR_DIR"] = w.fresh_store("profile")
    return w


def write(out, report, title, rows):
    """The diagnostic's report: a table of its steps' seconds."""
    def render(report):
        m = report["machine"]
        return "\n".join([
            f"Command: `{report['command']}`  ",
            f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}  ",
            f"{title} (a diagnostic: one run of each step)", "",
            "| step | seconds |", "|---|---:|",
            *[f"| {name} | {s:.2f} |" for name, s in rows], ""])

    write_report(report, out, render)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="language", choices=sorted(WORKLOADS))
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--no-adaptive", action="store_true",
                   help="record with a checkpoint every epoch")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = a.out or os.path.join(ROOT, "benchmarks", "results", f"profile-replay-{a.workload}"
                                + ("-every" if a.no_adaptive else ""))
    w = prepare(a.workload, a.epochs)
    py, script, args = sys.executable, w.script, w.args
    plain_wall, _ = timed(w, [py, script, *args])
    opts = ["--no-adaptive"] if a.no_adaptive else []
    rec_wall, _ = timed(w, [py, "-m", "flor", "record", *opts, script, *args])
    w.write(add_line(w.original, *w.spec["outer"]))
    rep_wall, _ = timed(w, [py, "-m", "flor", "replay", "--jobs", "1", script, *args])
    st = open_store(w.env["FLOR_DIR"])
    rec = next(r for r in st.runs() if r["kind"] == "record")
    rep = next(r for r in st.runs() if r["kind"] == "replay")
    compute = sum(b["compute_s"] for b in st.rows("blocks", rec["run_id"]))
    decisions = st.rows("decisions", rec["run_id"])
    restore = sum(b["restore_s"] for b in st.rows("blocks", rep["run_id"]))
    part_s = st.rows("parts", rep["run_id"])[0]["seconds"]
    with open(os.path.join(st.layout.run_dir(rep["run_id"]), "plan.json")) as f:
        plan = json.load(f)
    st.close()
    plan.pop("progress_fd", None)  # a pipe of the replay command, gone now
    plan_path = os.path.join(w.dir, "plan-again.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    threads = str(os.cpu_count() or 1)  # what `flor replay --jobs 1` gives its worker
    w_wall, marks = timed(w, [py, "-c", WRAP, plan_path],
                          {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    t_wall, t = timed(w, [py, "-c", WRAP])
    bare_wall, _ = timed(w, [py, "-c", "pass"])
    shutil.rmtree(os.path.dirname(w.dir), ignore_errors=True)
    outer = rec["finished"] - rec["started"] - compute
    rows = [
        ("plain run (whole command)", plain_wall),
        ("record (whole command)", rec_wall),
        ("record: its session's outer loop (session - blocks' compute)", outer),
        ("replay --jobs 1 (whole command)", rep_wall),
        ("replay: its worker's session (part seconds)", part_s),
        ("replay: restoring checkpoints, inside that session", restore),
        ("ideal of run.py: restore + outer loop", restore + outer),
        ("worker command run again alone (whole process)", w_wall),
        ("worker alone: its first line to session start (importing flor)",
         marks["session_start"]),
        ("worker alone: session start to exit handlers",
         marks["atexit"] - marks["session_start"]),
        ("worker alone: outside its code (interpreter start; after the exit handlers, "
         "finalization)", w_wall - marks["atexit"]),
        ("python -c 'import torch' (whole process)", t_wall),
        ("import torch: outside its code (interpreter start, finalization)",
         t_wall - t["atexit"]),
        ("python -c pass (whole process: interpreter start and exit)", bare_wall),
    ]
    title = (f"{a.workload}: `{w.spec['script']} {' '.join(args)}`, record "
             f"{' '.join(opts) or 'adaptive'} ({sum(d['checkpoint'] for d in decisions)} "
             f"checkpoints), epoch-loop probe replayed with --jobs 1")
    report = {
        "command": " ".join(["python benchmarks/profile_replay.py", *sys.argv[1:]]),
        "machine": machine(), "workload": a.workload, "args": args, "record_options": opts,
        "steps": dict(rows),
        "decisions": [{k: d[k] for k in ("block", "ctx", "n", "k", "compute_s", "nbytes",
                                         "bandwidth", "materialize_s", "ratio", "limit_value",
                                         "checkpoint", "reason")} for d in decisions],
    }
    write(out, report, title, rows)


if __name__ == "__main__":
    main()
