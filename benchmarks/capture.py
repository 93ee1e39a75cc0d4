"""What capturing a run's output costs: printed lines and large logged values.

  print   benchmarks/workloads/print_heavy.py (a training loop that prints a
          short line per step: 100,000 lines at the default size) run plain
          and under `python -m flor record`, stdout to a file, interleaved
          (the order shuffled in every round) and repeated; the overhead is
          the ratio of medians.  The runs see this environment as a user's
          shell has it (block-buffered stdout, cached bytecode).  A
          `--epochs 0` run of each shows the fixed
          cost of a record process (importing flor, opening the store,
          analysing the script), which is paid once per run, not per line.
  log     `flor.log("act", t)` of a tensor of 1M float32 elements (and of a
          numpy array of as many float64) at every step of a recorded loop:
          seconds the training thread spends in the call, median and p90
          over calls.  The values are written in the background (flor files
          under .flor/runs/<run>/values/).  Steady: a training step between
          calls gives the writer time to keep up.  Back-to-back: no step,
          so the writes fall behind and the staging memory grows (fresh
          pages, faulted in by the copy), up to the materializer's bound.

    python benchmarks/capture.py                  # 11 rounds, 100,000 lines
    python benchmarks/capture.py --rounds 3 --steps 1000
Writes benchmarks/results/capture.json and .md (see --out).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine_line, write_report  # noqa: E402  (benchmarks/harness.py)

WORKLOAD = os.path.join(ROOT, "benchmarks", "workloads", "print_heavy.py")

LOG_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import torch
    import flor

    torch.manual_seed(0)
    t = torch.randn(1_000_000)
    a = np.random.default_rng(0).standard_normal(1_000_000)
    w = torch.randn(256, 256)
    mms = int(sys.argv[2])  # the training step: this many 256x256 matmuls
    times = {"tensor": [], "array": [], "step": []}
    for it in flor.generator(range(int(sys.argv[1]))):
        t0 = time.perf_counter()
        for _ in range(mms):
            torch.mm(w, w)
        t.mul_(1.0001)
        times["step"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        flor.log("act", t)
        times["tensor"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        flor.log("arr", a)
        times["array"].append(time.perf_counter() - t0)
    with open(os.environ["LOG_TIMES"], "w") as f:
        json.dump(times, f)
""")


def _run(argv, cwd, env, out):
    with open(out, "w") as f:
        t0 = time.perf_counter()
        subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t0


def _user_env(**extra):
    """This environment as a user's shell has it: stdout to a file is block
    buffered and imports use cached bytecode (PYTHONUNBUFFERED and
    PYTHONDONTWRITEBYTECODE, set on some CI machines, are left out)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")}
    env.update(extra)
    return env


def bench_print(args, work):
    env = _user_env(FLOR_DIR=os.path.join(work, ".flor"))
    sizes = {"lines": ["--epochs", str(args.epochs), "--steps", str(args.steps)],
             "startup": ["--epochs", "0"]}
    kinds = {"plain": [sys.executable, WORKLOAD],
             "record": [sys.executable, "-m", "flor", "record", WORKLOAD]}
    raw = {f"{s}/{k}": [] for s in sizes for k in kinds}
    outs = {}
    for kind in kinds.values():  # a warm-up: bytecode caches written
        _run(kind + sizes["startup"], work, env, os.devnull)
    for r in range(args.rounds):
        order = list(raw)
        random.Random(r).shuffle(order)
        for name in order:
            size, kind = name.split("/")
            out = os.path.join(work, f"{size}-{kind}.out")
            raw[name].append(_run(kinds[kind] + sizes[size], work, env, out))
            with open(out) as f:
                outs[name] = f.read()
    if outs["lines/plain"] != outs["lines/record"]:
        raise SystemExit("record printed something other than the plain run")
    med = {k: statistics.median(v) for k, v in raw.items()}
    lines = outs["lines/plain"].count("\n")
    return {"lines": lines, "raw_s": raw, "median_s": med,
            "overhead": med["lines/record"] / med["lines/plain"] - 1,
            "startup_extra_s": med["startup/record"] - med["startup/plain"],
            "per_line_extra_us": 1e6 * ((med["lines/record"] - med["startup/record"])
                                        - (med["lines/plain"] - med["startup/plain"])) / lines}


def bench_log(args, work):
    script = os.path.join(work, "log_large.py")
    with open(script, "w") as f:
        f.write(LOG_SCRIPT)
    times = os.path.join(work, "times.json")
    res = {}
    for pace, mms in (("steady", args.step_mms), ("back-to-back", 0)):
        env = _user_env(FLOR_DIR=os.path.join(work, f".flor-{pace}"), LOG_TIMES=times)
        subprocess.run([sys.executable, "-m", "flor", "record", script, str(args.calls),
                        str(mms)], cwd=work, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        with open(times) as f:
            t = json.load(f)
        step = statistics.median(t.pop("step"))
        res[pace] = {k: {"calls": len(v), "step_ms": 1e3 * step,
                         "median_ms": 1e3 * statistics.median(v),
                         "p90_ms": 1e3 * statistics.quantiles(v, n=10)[-1],
                         "max_ms": 1e3 * max(v), "ms": [1e3 * x for x in v]}
                     for k, v in t.items()}
    return res


def markdown(r):
    p, lg = r["print"], r["log"]
    m = p["median_s"]
    out = [f"Machine: {r['machine']}.  Command: `{r['command']}`.", "",
           f"Printed lines: {p['lines']:,} lines, {r['rounds']} interleaved rounds (medians).", "",
           "| run | plain (s) | flor record (s) | extra |", "|---|---|---|---|",
           f"| {p['lines']:,} lines | {m['lines/plain']:.2f} | {m['lines/record']:.2f} | "
           f"{100 * p['overhead']:+.1f}% |",
           f"| startup only (`--epochs 0`) | {m['startup/plain']:.2f} | "
           f"{m['startup/record']:.2f} | {p['startup_extra_s']:+.2f} s |", "",
           f"Beyond the fixed startup cost: {p['per_line_extra_us']:.2f} us per printed line.", "",
           "`flor.log` of a large value in a recorded loop, training-thread time per call "
           "(a tensor and an array logged at every step; steady: a training step between "
           "calls, back-to-back: none, so the background writes fall behind):", "",
           "| value | pace | step (ms) | calls | median (ms) | p90 (ms) | max (ms) |",
           "|---|---|---|---|---|---|---|"]
    for k, label in (("tensor", "torch tensor, 1M float32"), ("array", "numpy array, 1M float64")):
        for pace, row in lg.items():
            v = row[k]
            out.append(f"| {label} | {pace} | {v['step_ms']:.0f} | {v['calls']} | "
                       f"{v['median_ms']:.2f} | {v['p90_ms']:.2f} | {v['max_ms']:.2f} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--calls", type=int, default=50, help="flor.log calls of each value")
    ap.add_argument("--step-mms", type=int, default=150,
                    help="256x256 matmuls in the steady training step")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "capture"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        r = {"command": "python benchmarks/capture.py " + " ".join(sys.argv[1:]),
             "machine": machine_line(),
             "rounds": args.rounds,
             "print": bench_print(args, work), "log": bench_log(args, work)}
    r["command"] = r["command"].strip()
    write_report(r, args.out, markdown)


if __name__ == "__main__":
    main()
