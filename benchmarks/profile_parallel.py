"""Diagnostic (not a benchmark): where two replay workers spend their time.

Records one workload hands-free, adds run.py's inner-loop print, replays it
with --jobs 1 and then --jobs 2 (each timed as a whole command), and reads
flor's own accounting of each worker from the run store: its session, its
main loop, and within that the blocks it computed and the checkpoints it
restored (all of its blocks: the workloads' only block is their training
loop), and the rest (the outer loop).  One run of each step.

    python benchmarks/profile_parallel.py [--workload image] [--epochs 24]

Writes benchmarks/results/profile-parallel-WORKLOAD.json and .md (or --out).
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, add_line, machine, open_store  # noqa: E402
from profile_replay import prepare, timed, write  # noqa: E402
from run import WORKLOADS  # noqa: E402


def accounting(st, run_id, main_loop, main_run):
    """Per worker: session seconds, main-loop seconds and iterations, and its
    blocks (all of them: computed, restored) from the store."""
    parts = {p["part"]: {"session_s": p["seconds"], "main_loop_s": 0.0, "iterations": 0,
                         "block_compute_s": 0.0, "restore_s": 0.0, "restores": 0}
             for p in st.rows("parts", run_id)}
    for loop in st.rows("loops", run_id):
        if (loop["loop"], loop["run"], loop["depth"]) == (main_loop, main_run, 0):
            parts[loop["part"]].update(main_loop_s=loop["seconds"],
                                       iterations=loop["iterations"])
    for b in st.rows("blocks", run_id):
        p = parts[b["part"]]
        p["block_compute_s"] += b["compute_s"]
        p["restore_s"] += b["restore_s"]
        p["restores"] += b["restores"]
    for p in parts.values():
        p["outer_s"] = p["main_loop_s"] - p["block_compute_s"] - p["restore_s"]
    return [parts[k] for k in sorted(parts)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="image", choices=sorted(WORKLOADS))
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = a.out or os.path.join(ROOT, "benchmarks", "results", f"profile-parallel-{a.workload}")
    w = prepare(a.workload, a.epochs)
    w.env["FLOR_ALL_JOBS"] = "1"  # --jobs 2 starts two workers: what this profiles
    py, script, args = sys.executable, w.script, w.args
    rec_wall, _ = timed(w, [py, "-m", "flor", "record", script, *args])
    w.write(add_line(w.original, *w.spec["inner"]))
    replays = []
    for jobs in (1, 2):
        wall, _ = timed(w, [py, "-m", "flor", "replay", "--jobs", str(jobs), script, *args])
        st = open_store(w.env["FLOR_DIR"])
        rep = [r for r in st.runs() if r["kind"] == "replay"][-1]
        replays.append({"jobs": jobs, "wall_s": wall,
                        "segments": rep["info"].segments,
                        "workers": accounting(st, rep["run_id"], rep["main_loop"],
                                              rep["main_run"])})
        st.close()
    shutil.rmtree(os.path.dirname(w.dir), ignore_errors=True)
    one, two = replays
    outside = one["wall_s"] - one["workers"][0]["main_loop_s"]
    rows = [("record (whole command)", rec_wall)]
    for r in replays:
        rows.append((f"replay --jobs {r['jobs']} (whole command), segments "
                     f"{', '.join(f'[{s}, {e})' for s, e in r['segments'])}", r["wall_s"]))
        for i, wk in enumerate(r["workers"]):
            pre = f"--jobs {r['jobs']} worker {i}"
            rows += [(f"{pre}: session", wk["session_s"]),
                     (f"{pre}: main loop, {wk['iterations']} iterations", wk["main_loop_s"]),
                     (f"{pre}: training blocks computed", wk["block_compute_s"]),
                     (f"{pre}: restoring {wk['restores']} checkpoints", wk["restore_s"]),
                     (f"{pre}: rest of the main loop (outer loop)", wk["outer_s"])]
    rows += [("--jobs 1: outside its main loop (whole command - main loop)", outside),
             ("ideal --jobs 2: --jobs 1 / 2", one["wall_s"] / 2)]
    efficiency = one["wall_s"] / (2 * two["wall_s"])
    title = (f"{a.workload}: `{w.spec['script']} {' '.join(args)}`, recorded adaptive, "
             f"inner-loop probe replayed with --jobs 1 and --jobs 2 (efficiency "
             f"{100 * efficiency:.0f}%)")
    report = {"command": " ".join(["python benchmarks/profile_parallel.py", *sys.argv[1:]]),
              "machine": machine(), "workload": a.workload, "args": args,
              "record_s": rec_wall, "replays": replays, "outside_main_loop_s": outside,
              "efficiency": efficiency}
    write(out, report, title, rows)


if __name__ == "__main__":
    main()
