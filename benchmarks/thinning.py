"""The disk that a record's iteration checkpoints take, with the default
bound (`--iteration-checkpoints`, flor/runtime/thinning.py) and without one
(a bound no loop reaches), and what each costs the record and a replay.

For each step-loop workload, each round runs, in a shuffled order: a plain
run of the script edited with a statement in its training step; and, for
each bound, a record of the original script (into a store of its own)
followed by a `--jobs 2` replay of the edited script.  The checkpoint
directory is sampled every 200 ms while a record runs (its peak size), and
measured when it ends.  The report gives medians, and whether every replay
printed exactly what the plain run printed, with its checks passing.

    python benchmarks/thinning.py                 # 2 rounds
    python benchmarks/thinning.py --only makemore_steps.py --rounds 1
Writes benchmarks/results/thinning.json and .md (see --out).
"""
import argparse
import os
import random
import re
import shutil
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (ROOT, add_line, header_line, load_average, median, report_header,  # noqa: E402
                     script_env, timed, write_report)

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")
GNORM = ('print(f"  gnorm {sum(p.grad.norm() ** 2 for p in model.parameters() '
         'if p.grad is not None).item() ** 0.5:.6f}")')
CASES = {  # script: (arguments, anchor of the statement in the training step)
    "makemore_steps.py": (["--max-steps", "12000"], "loss.backward()"),
    "gpt_accum.py": (["--max-iters", "120", "--accum", "4", "--log-interval", "10"],
                     "loss.backward()"),
}
BOUNDS = {"default": [], "unbounded": ["--iteration-checkpoints", "1000000"]}
CLOCK = re.compile(r"(time [0-9.]+ms|ms/batch +[0-9.]+|time: +[0-9.]+s)")


def dir_bytes(d):
    total = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass  # removed meanwhile
    return total


def record(argv, cwd, env, store):
    """Run a record; (seconds, process, peak and final checkpoint bytes)."""
    runs = os.path.join(store, "runs")
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], dir_bytes(runs))

    t = threading.Thread(target=sample)
    t.start()
    try:
        dt, proc = timed(argv, cwd, env)
    finally:
        done.set()
        t.join()
    final = dir_bytes(runs)
    return dt, proc, max(peak[0], final), final


def bench(name, rounds, work, rng):
    args, anchor = CASES[name]
    with open(os.path.join(WORKLOADS, name)) as f:
        original = f.read()
    edited = add_line(original, anchor, GNORM)
    assert edited != original, f"{name}: no line holds {anchor!r}"
    dirs = {b: os.path.join(work, f"{name[:-3]}-{b}") for b in BOUNDS}
    for d in dirs.values():
        os.makedirs(d)
    plain_dir = os.path.join(work, f"{name[:-3]}-plain")
    os.makedirs(plain_dir)
    with open(os.path.join(plain_dir, name), "w") as f:
        f.write(edited)
    plain_env = script_env(os.path.join(plain_dir, ".flor"))
    timed([sys.executable, name, *args], plain_dir, plain_env)  # warm-up
    raw = {k: [] for k in ["plain", *(f"{b}_{w}" for b in BOUNDS for w in ("record", "replay"))]}
    sizes = {b: {"peak": [], "final": []} for b in BOUNDS}
    outs, errs = {}, {}
    for _ in range(rounds):
        for job in rng.sample(["plain", *BOUNDS], len(BOUNDS) + 1):
            if job == "plain":
                dt, proc = timed([sys.executable, name, *args], plain_dir, plain_env)
                raw["plain"].append(dt)
                outs["plain"] = CLOCK.sub("<clock>", proc.stdout)
                continue
            d, store = dirs[job], os.path.join(dirs[job], ".flor")
            shutil.rmtree(store, ignore_errors=True)
            env = script_env(store)
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write(original)
            dt, proc, peak, final = record(
                [sys.executable, "-m", "flor", "record", *BOUNDS[job], name, *args], d, env, store)
            raw[f"{job}_record"].append(dt)
            sizes[job]["peak"].append(peak)
            sizes[job]["final"].append(final)
            errs[f"{job}_record"] = proc.stderr
            with open(path, "w") as f:
                f.write(edited)
            dt, proc = timed([sys.executable, "-m", "flor", "replay", "--jobs", "2", name, *args],
                             d, env)
            raw[f"{job}_replay"].append(dt)
            outs[job] = CLOCK.sub("<clock>", proc.stdout)
            errs[f"{job}_replay"] = proc.stderr
    med = {k: median(v) for k, v in raw.items()}
    result = {"args": args, "median_s": med, "raw_s": raw}
    for b in BOUNDS:
        ck = re.search(r"and (\d+) iteration checkpoints", errs[f"{b}_record"])
        result[b] = {
            "iteration_checkpoints": int(ck.group(1)) if ck else 0,
            "peak_mib": median(sizes[b]["peak"]) / 2**20,
            "final_mib": median(sizes[b]["final"]) / 2**20,
            "speedup": med["plain"] / med[f"{b}_replay"],
            "segments": (re.findall(r"in segments (.*)", errs[f"{b}_replay"]) or [""])[0],
            "stdout_equal": outs[b] == outs["plain"],
            "checks_passed": "deferred checks passed" in errs[f"{b}_replay"]}
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "thinning"))
    args = ap.parse_args()
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-thinning-")
    report = dict(report_header("thinning.py", args.rounds), scripts={})
    try:
        for name in args.only.split(","):
            report["scripts"][name] = r = bench(name, args.rounds, work, rng)
            print(f"{name}: " + ", ".join(
                f"{b} {r[b]['iteration_checkpoints']} kept, {r[b]['final_mib']:.1f} MiB "
                f"(peak {r[b]['peak_mib']:.1f})" for b in BOUNDS), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_after"] = load_average()
    write_report(report, args.out, render)


def render(report):
    lines = [header_line(report) + (
                 ", medians.  Disk: the run's checkpoint directory, at its peak during the "
                 "record (sampled every 200 ms) and at its end.  Replay: a statement in the "
                 "training step, `--jobs 2`; speed-up = a plain run of the edited script / "
                 "the replay."), "",
             "| script | bound | record (s) | iteration checkpoints kept | disk at end (MiB) | "
             "peak (MiB) | replay speed-up | segments | output = plain, checks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["scripts"].items():
        for b in BOUNDS:
            x = r[b]
            label = "default (64)" if b == "default" else "none"
            lines.append(
                f"| {name} | {label} | {r['median_s'][f'{b}_record']:.1f} | "
                f"{x['iteration_checkpoints']} | {x['final_mib']:.1f} | {x['peak_mib']:.1f} | "
                f"{x['speedup']:.2f}x | {x['segments']} | "
                f"{'yes' if x['stdout_equal'] and x['checks_passed'] else 'NO'} |")
    lines.append("")
    lines.append("Plain runs of the edited scripts: " + ", ".join(
        f"{name} {r['median_s']['plain']:.1f} s" for name, r in report["scripts"].items()) + ".")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
