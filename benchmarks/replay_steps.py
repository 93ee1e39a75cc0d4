"""What a record and a replay add to each iteration of a step loop, beyond
the step's own work (and the probe's).

The workload is benchmarks/workloads/makemore_steps.py (a `while True` step
loop with the training step inline, as makemore trains).  For two loop
lengths it records the script, adds a probe in the step loop (so that a
replay runs every step again), then in each round runs, in a shuffled
order: the script plain and recorded (into a store of its own), and the
edited script plain and replayed (--jobs 1).  The difference of the two
lengths' medians cancels what does not grow with the loop (process start,
imports, planning, the checks):

    per-iteration overhead = ((flor(L) - flor(S)) - (plain(L) - plain(S))) / (L - S)

Each run also says how long its training loop took (--loop-seconds), and
the runs of one round are paired: the median over rounds of
(flor's loop - the plain run's loop) / L is the same overhead with start-up
out of the measure and a neighbour's load shared within a round.

    python benchmarks/replay_steps.py                  # 3 rounds, 1000 and 6000 steps
Writes benchmarks/results/replay-steps.json and .md (see --out).
"""
import argparse
import os
import random
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (ROOT, add_line, load_average, machine, machine_line, median,  # noqa: E402
                     timed, write_report)

SCRIPT = os.path.join(ROOT, "benchmarks", "workloads", "makemore_steps.py")
PROBE = ("optimizer.step()", 'print(f"  loss {loss.item():.6f}")')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default="1000,6000", help="the two loop lengths, S,L")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "replay-steps"))
    args = ap.parse_args()
    short, long_ = (int(x) for x in args.steps.split(","))
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-steps-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOR_")}
    env.update(FLOR_DIR=os.path.join(work, ".flor"), OMP_NUM_THREADS="1")
    with open(SCRIPT) as f:
        original = f.read()
    edited = add_line(original, *PROBE)
    def name(n):  # a script per length: replay takes the latest record of the script
        return f"train_{n}.py"

    def recorded(n):  # the script the rounds record, with a store of its own
        return f"record_{n}.py"

    rec_env = dict(env, FLOR_DIR=os.path.join(work, ".flor-rounds"))

    load = load_average()
    kinds = ("plain", "record", "plain_edited", "replay")
    raw = {(kind, n): [] for kind in kinds for n in (short, long_)}
    loops = {k: [] for k in raw}  # the training loop's seconds, as each run said
    same = True
    try:
        for n in (short, long_):
            with open(os.path.join(work, name(n)), "w") as f:
                f.write(original)
            timed([sys.executable, "-m", "flor", "record", name(n), "--max-steps", str(n),
                   "--loop-seconds"], work, env)
            with open(os.path.join(work, name(n)), "w") as f:
                f.write(edited)
            with open(os.path.join(work, recorded(n)), "w") as f:
                f.write(original)
        for _ in range(args.rounds):
            order = list(raw)
            rng.shuffle(order)
            outs = {}
            for kind, n in order:
                argv = {"plain": [sys.executable, recorded(n)],
                        "record": [sys.executable, "-m", "flor", "record", recorded(n)],
                        "plain_edited": [sys.executable, name(n)],
                        "replay": [sys.executable, "-m", "flor", "replay", name(n)]}[kind]
                dt, proc = timed(argv + ["--max-steps", str(n), "--loop-seconds"], work,
                                 rec_env if kind == "record" else env)
                raw[(kind, n)].append(dt)
                loops[(kind, n)].append(loop_seconds(proc.stderr))
                outs[(kind, n)] = proc.stdout
            same = same and all(outs[("plain", n)] == outs[("record", n)] and
                                outs[("plain_edited", n)] == outs[("replay", n)]
                                for n in (short, long_))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: median(v) for k, v in raw.items()}
    grow = {kind: med[(kind, long_)] - med[(kind, short)] for kind in kinds}
    load_after = load_average()
    report = {"command": ("python benchmarks/replay_steps.py " + " ".join(sys.argv[1:])).strip(),
              "machine": machine(), "machine_line": machine_line(), "rounds": args.rounds,
              "load_before": load, "load_after": load_after, "steps": [short, long_],
              "median_s": {f"{k}_{n}": v for (k, n), v in med.items()},
              "raw_s": {f"{k}_{n}": v for (k, n), v in raw.items()},
              "plain_per_step_us": grow["plain"] / (long_ - short) * 1e6,
              "record_overhead_per_step_us": (grow["record"] - grow["plain"]) /
              (long_ - short) * 1e6,
              "overhead_per_step_us": (grow["replay"] - grow["plain_edited"]) /
              (long_ - short) * 1e6,
              "loop_s": {f"{k}_{n}": v for (k, n), v in loops.items()},
              "record_in_loop_per_step_us": paired(loops, "record", "plain", long_),
              "replay_in_loop_per_step_us": paired(loops, "replay", "plain_edited", long_),
              "stdout_equal": same}
    write_report(report, args.out, render)


def loop_seconds(stderr):
    """The training loop's seconds a run of the workload said."""
    got = re.findall(r"^loop seconds: (\S+)$", stderr, re.M)
    if len(got) != 1:
        sys.exit(f"the workload did not say its loop's seconds once:\n{stderr[-2000:]}")
    return float(got[0])


def paired(loops, kind, base, n):
    """Median over rounds of (`kind`'s loop - `base`'s loop of the same
    round) / n, in µs per step."""
    return median([(a - b) / n * 1e6 for a, b in zip(loops[(kind, n)], loops[(base, n)])])


def render(r):
    s, l = r["steps"]
    m = r["median_s"]
    rows = "".join(f"| {n} | {m[f'plain_{n}']:.2f} | {m[f'record_{n}']:.2f} | "
                   f"{m[f'plain_edited_{n}']:.2f} | {m[f'replay_{n}']:.2f} |\n" for n in (s, l))
    bound = r["plain_per_step_us"] / 15
    return (f"Machine: {r['machine_line']}; one torch thread; load average "
            f"{' '.join(r['load_before'])} before, {' '.join(r['load_after'])} after.  "
            f"Command: `{r['command']}`; {r['rounds']} interleaved rounds, medians.\n\n"
            "| steps | plain (s) | record (s) | plain, edited (s) | replay, --jobs 1 (s) |\n"
            f"|---|---|---|---|---|\n{rows}\n"
            f"A step costs {r['plain_per_step_us']:.0f} µs in a plain run; record adds "
            f"**{r['record_overhead_per_step_us']:.0f} µs per step** (1/15 of the step: "
            f"{bound:.0f} µs), and replay **{r['overhead_per_step_us']:.0f} µs per step** "
            f"beyond the probe (goal: 50).  Timed inside the training loop and paired "
            f"within rounds ({r['steps'][1]} steps): record adds "
            f"**{r['record_in_loop_per_step_us']:.0f} µs per step**, replay "
            f"**{r['replay_in_loop_per_step_us']:.0f} µs**.  Record and replay printed what "
            f"the plain runs printed: {'yes' if r['stdout_equal'] else 'NO'}.\n")


if __name__ == "__main__":
    main()
