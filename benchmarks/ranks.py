"""Data-parallel records: replicated state written once (by the rank that
decides each checkpoint) against every rank writing all of it.

torchrun starts 2 ranks of benchmarks/workloads/ddp_wide.py (a wide MLP
under DistributedDataParallel, Adam, gloo on the CPU), recorded hands-free
with a checkpoint at every block execution and iteration (FLOR_ADAPTIVE=0,
the most writing a record does).  Each round runs, in a shuffled order:
plain (no flor), once (flor's default) and every (FLOR_REPLICATED=every:
each rank writes the replicated model and optimizer itself).  Reported:
medians over rounds of the epoch loop's seconds (the slowest rank's: DDP
ranks wait for each other), the record's overhead over plain, and the bytes
all ranks wrote.

    python benchmarks/ranks.py                 # 3 rounds
Writes benchmarks/results/ranks.json and .md (see --out).
"""
import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from harness import cpu_name, write_report  # noqa: E402

SCRIPT = os.path.join(HERE, "workloads", "ddp_wide.py")
CONFIGS = {"plain": None, "once": {}, "every": {"FLOR_REPLICATED": "every"}}


def run(config, args, work):
    store = os.path.join(work, f"store-{config}")
    shutil.rmtree(store, ignore_errors=True)
    env = dict(os.environ, FLOR_DIR=store, FLOR_ADAPTIVE="0", OMP_NUM_THREADS="1")
    env.update(CONFIGS[config] or {})
    flor = [] if CONFIGS[config] is None else ["-m", "flor", "record"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
           *flor, SCRIPT, "--epochs", str(args.epochs), "--width", str(args.width),
           "--layers", str(args.layers)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")
    loops = [float(x) for x in re.findall(r"loop_s ([0-9.]+)", proc.stdout)]
    written = 0
    for base, _, files in os.walk(os.path.join(store, "runs")):
        if os.path.basename(base) == "ckpt":
            written += sum(os.path.getsize(os.path.join(base, f)) for f in files)
    shutil.rmtree(store, ignore_errors=True)
    return {"loop_s": max(loops), "bytes": written}


def render(rep):
    MiB = 2 ** 20
    lines = [f"Command: `{rep['command'].strip()}`  ",
             f"Machine: {rep['machine']}; {rep['ranks']} ranks (gloo, one torch thread "
             f"each), state per rank {rep['state_mib']:.0f} MiB (model + Adam), "
             f"{rep['epochs']} epochs, a checkpoint at every block execution and iteration "
             "(FLOR_ADAPTIVE=0).  Medians of "
             f"{rep['rounds']} interleaved rounds.", "",
             "| config | epoch loop (s, slowest rank) | overhead | written (MiB, all ranks) |",
             "|---|---|---|---|"]
    plain = rep["configs"]["plain"]["loop_s"]
    for name, c in rep["configs"].items():
        over = "-" if name == "plain" else f"{c['loop_s'] / plain - 1:+.0%}"
        written = "-" if name == "plain" else f"{c['bytes'] / MiB:.0f}"
        lines.append(f"| {name} | {c['loop_s']:.2f} | {over} | {written} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ranks"))
    args = ap.parse_args()
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-ranks-")
    params = 64 * args.width + args.layers * args.width * (args.width + 1) + \
        (args.width + 1) * 10 + args.width
    raw = {name: [] for name in CONFIGS}
    try:
        run("plain", args, work)  # warm-up: page cache, imports
        for r in range(args.rounds):
            order = list(CONFIGS)
            rng.shuffle(order)
            for name in order:
                res = run(name, args, work)
                raw[name].append(res)
                print(f"round {r} {name}: {res['loop_s']:.2f} s, {res['bytes'] / 2**20:.0f} MiB",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"command": "python benchmarks/ranks.py " + " ".join(sys.argv[1:]),
              "machine": f"{cpu_name()}, {os.cpu_count()} cores", "rounds": args.rounds,
              "ranks": args.ranks, "epochs": args.epochs,
              "state_mib": 3 * 4 * params / 2 ** 20,
              "configs": {name: {"loop_s": statistics.median(x["loop_s"] for x in runs),
                                 "bytes": statistics.median(x["bytes"] for x in runs)}
                          for name, runs in raw.items()},
              "raw": raw}
    write_report(report, args.out, render)


if __name__ == "__main__":
    main()
