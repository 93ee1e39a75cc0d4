"""Diagnostic (not a benchmark): where an epoch-loop probe replay spends the
time that the partial-replay ideal of benchmarks/run.py leaves out.

Runs one workload plainly, records it hands-free, adds run.py's epoch-loop print, replays it
with --jobs 1 (timed as a whole command), then runs that replay's worker
command once more on its own, with timestamps taken inside it: after
interpreter start, when flor's replay session starts, at exit (atexit, after
the script and the session have finished) and, from outside, when the
process is gone.  A bare `python -c "import torch"` is timed the same way
for reference.

    python benchmarks/profile_replay.py [--workload language] [--epochs 12]
    python benchmarks/profile_replay.py --workload finetune --no-adaptive
                                   # a checkpoint every epoch: what restoring costs
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import ROOT, WORKLOADS, WORKLOADS_DIR, _store  # noqa: E402
from replay import add_line  # noqa: E402

WRAP = r"""
import atexit, json, sys, time
t0 = time.perf_counter()
marks = {}
import flor.session as S
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


def timed(argv, cwd, env):
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"{argv} failed:\n{proc.stderr[-3000:]}")
    marks = [json.loads(line[6:]) for line in proc.stderr.splitlines()
             if line.startswith("MARKS ")]
    return wall, (marks[0] if marks else {})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="language", choices=sorted(WORKLOADS))
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--no-adaptive", action="store_true",
                   help="record with a checkpoint every epoch")
    a = p.parse_args()
    spec = WORKLOADS[a.workload]
    args = list(spec["full"])
    if a.epochs is not None:
        args[args.index("--epochs") + 1] = str(a.epochs)
    work = tempfile.mkdtemp(prefix="flor-profile-replay-")
    script = os.path.join(work, spec["script"])
    with open(os.path.join(WORKLOADS_DIR, spec["script"])) as f:
        source = f.read()
    with open(script, "w") as f:
        f.write(source)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               FLOR_DIR=os.path.join(work, ".flor"), PYTHONPATH=ROOT)
    py = sys.executable
    plain_wall, _ = timed([py, script, *args], work, env)
    # As in run.py, the measured record starts from a store that already
    # holds this machine's bandwidth calibration (taken by a short record).
    short = list(args)
    short[short.index("--epochs") + 1] = "1"
    timed([py, "-m", "flor", "record", script, *short], work,
          dict(env, FLOR_DIR=os.path.join(work, "warm")))
    os.makedirs(env["FLOR_DIR"])
    shutil.copy(os.path.join(work, "warm", "calibration.json"), env["FLOR_DIR"])
    opts = ["--no-adaptive"] if a.no_adaptive else []
    rec_wall, _ = timed([py, "-m", "flor", "record", *opts, script, *args], work, env)
    with open(script, "w") as f:
        f.write(add_line(source, *spec["outer"]))
    rep_wall, _ = timed([py, "-m", "flor", "replay", "--jobs", "1", script, *args], work, env)
    st = _store(env["FLOR_DIR"])
    rec = next(r for r in st.runs() if r["kind"] == "record")
    rep = next(r for r in st.runs() if r["kind"] == "replay")
    compute = sum(b["compute_s"] for b in st.rows("blocks", rec["run_id"]))
    ckpts = sum(d["checkpoint"] for d in st.rows("decisions", rec["run_id"]))
    restore = sum(b["restore_s"] for b in st.rows("blocks", rep["run_id"]))
    part_s = st.rows("parts", rep["run_id"])[0]["seconds"]
    plan = os.path.join(st.run_dir(rep["run_id"]), "plan.json")
    st.close()
    w_wall, w = timed([py, "-c", WRAP, plan], work, env)
    t_wall, t = timed([py, "-c", WRAP], work, env)
    outer = rec["finished"] - rec["started"] - compute
    rows = [
        ("plain run (whole command)", plain_wall),
        ("record (whole command)", rec_wall),
        ("  its session: outer loop = session - blocks' compute", outer),
        ("replay --jobs 1 (whole command)", rep_wall),
        ("  its worker's session (part seconds)", part_s),
        ("    of which restoring checkpoints", restore),
        ("ideal of run.py: restore + outer loop", restore + outer),
        ("worker command alone (whole process)", w_wall),
        ("  interpreter start to session start", w.get("session_start", float("nan"))),
        ("  session start to atexit", w["atexit"] - w.get("session_start", 0.0)),
        ("  atexit to process gone (finalization)", w_wall - w["atexit"]),
        ("python -c 'import torch' (whole process)", t_wall),
        ("  atexit to process gone (finalization)", t_wall - t["atexit"]),
    ]
    print(f"{a.workload}: {spec['script']} {' '.join(args)}; record {' '.join(opts) or 'adaptive'}, "
          f"{ckpts} checkpoints")
    for name, s in rows:
        print(f"{name:<58} {s:7.2f} s")


if __name__ == "__main__":
    main()
