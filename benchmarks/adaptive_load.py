"""Does the adaptive rule checkpoint as often beside a noisy neighbour, and
on a script whose steps drift, as it does on a quiet machine?

For each workload, each round runs in a shuffled order: the plain script and
a hands-free record, each on a quiet machine and beside a neighbour (a
process per core, computing and idling in turns together, seeded per round
so that every command of a round meets the same turns).  With --before DIR, a record by the
flor tree in DIR (its built extension in place) runs too, in the same rounds.
The report gives, per flor tree, the checkpoints of each record (quiet and
loaded), the loaded/quiet ratio of their medians, and the record's overhead
over the plain run under the same load (medians).

    python benchmarks/adaptive_load.py                        # 2 rounds
    python benchmarks/adaptive_load.py --before /tmp/old-flor --rounds 3
Writes benchmarks/results/adaptive-load.json and .md (see --out).
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (ROOT, machine, machine_line, median, open_store, script_env,  # noqa: E402
                     timed, write_report)

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")
CASES = {  # script: arguments
    "curriculum_lm.py": ["--epochs", "10"],  # each epoch slower than the last
    "image_cnn.py": ["--epochs", "8"],
    "mnist_helpers.py": ["--epochs", "8"],
    "finetune.py": ["--epochs", "20"],  # a large frozen backbone: 321.6 MiB a checkpoint
}
# A neighbour: computes, then idles, in turns of 0.3 to 3 s each.
NEIGHBOUR = """
import random, sys, time
rng = random.Random(int(sys.argv[1]))
while True:
    end = time.monotonic() + rng.uniform(0.3, 3.0)
    while time.monotonic() < end:
        sum(i * i for i in range(1000))
    time.sleep(rng.uniform(0.3, 3.0))
"""


def run(work, name, tree, seed):
    """One command: (seconds, checkpoints or None); `tree`: None for the
    plain script, else the flor tree that records it; `seed`: the
    neighbour's, or None for a quiet machine."""
    store = tempfile.mkdtemp(prefix="store-", dir=work)
    env = script_env(store)
    if tree:
        env["PYTHONPATH"] = tree
    argv = [sys.executable, *(["-m", "flor", "record"] if tree else []), name, *CASES[name]]
    # The neighbour: a process per core, all computing and idling together.
    neighbour = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(seed)])
                 for _ in range(os.cpu_count() if seed is not None else 0)]
    try:
        dt, _ = timed(argv, cwd=work, env=env)
    finally:
        for p in neighbour:
            p.send_signal(signal.SIGKILL)
            p.wait()
    ckpts = None
    if tree:
        st = open_store(store)
        rec = st.runs()[-1]
        ckpts = sum(1 for d in st.rows("decisions", rec["run_id"]) if d["checkpoint"])
        st.close()
    shutil.rmtree(store, ignore_errors=True)
    return dt, ckpts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--before", default=None,
                    help="a flor tree (built) whose records run beside this one's")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "adaptive-load"))
    args = ap.parse_args()
    trees = {"now": ROOT}
    if args.before:
        trees["before"] = os.path.abspath(args.before)
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-adaptive-load-")
    report = {"command": "python benchmarks/adaptive_load.py " + " ".join(sys.argv[1:]),
              "machine": machine(), "rounds": args.rounds, "trees": list(trees),
              "workloads": {}}
    try:
        for name in args.only.split(","):
            shutil.copy(os.path.join(WORKLOADS, name), work)
            run(work, name, None, None)  # warm-up: page cache, bytecode
            raw = {}
            for r in range(args.rounds):
                cmds = [(tree, load) for tree in [None, *trees] for load in ("quiet", "loaded")]
                rng.shuffle(cmds)
                for tree, load in cmds:
                    dt, ckpts = run(work, name, trees.get(tree), 1000 + r if load == "loaded"
                                    else None)
                    raw.setdefault(f"{tree or 'plain'} {load}", []).append(
                        {"seconds": dt, "checkpoints": ckpts})
                    print(f"{name} round {r} {tree or 'plain'} {load}: {dt:.1f} s"
                          f"{'' if ckpts is None else f', {ckpts} checkpoints'}",
                          file=sys.stderr, flush=True)
            out = {"args": CASES[name], "raw": raw}
            for load in ("quiet", "loaded"):
                out[f"plain {load} s"] = median(x["seconds"] for x in raw[f"plain {load}"])
            for tree in trees:
                t = out[tree] = {}
                for load in ("quiet", "loaded"):
                    rows = raw[f"{tree} {load}"]
                    t[f"{load} checkpoints"] = [x["checkpoints"] for x in rows]
                    t[f"{load} overhead"] = (median(x["seconds"] for x in rows)
                                             / out[f"plain {load} s"] - 1)
                t["loaded / quiet"] = (median(t["loaded checkpoints"])
                                       / max(median(t["quiet checkpoints"]), 1))
            report["workloads"][name] = out
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(report, args.out, render)


def render(report):
    lines = [f"Machine: {machine_line()}.  Command: `{report['command'].strip()}`; "
             f"{report['rounds']} interleaved rounds, medians.  Loaded: beside processes that "
             "compute and idle together in turns of 0.3 to 3 s, one per core.", "",
             "| script | flor | checkpoints quiet | checkpoints loaded | loaded / quiet | "
             "overhead quiet | overhead loaded |", "|---|---|---|---|---|---|---|"]
    for name, w in report["workloads"].items():
        for tree in report["trees"]:
            t = w[tree]
            lines.append(
                f"| {name} {' '.join(w['args'])} | {tree} | "
                f"{', '.join(map(str, t['quiet checkpoints']))} | "
                f"{', '.join(map(str, t['loaded checkpoints']))} | {t['loaded / quiet']:.2f} | "
                f"{100 * t['quiet overhead']:+.1f}% | {100 * t['loaded overhead']:+.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
