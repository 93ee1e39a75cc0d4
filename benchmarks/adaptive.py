"""How often the adaptive rule checkpoints, and what recording costs with it.

On the three evaluation workloads of benchmarks/run.py (same scripts, sizes
and environment), each round runs the plain script and an adaptive hands-free
record of it, in a shuffled order; the report gives medians over rounds,
the record's overhead over plain, and its checkpoint count.  The figures
of the rule as it was before it charged what training pays (it charged the
whole background write) are read from benchmarks/results/evaluation.json,
measured by benchmarks/run.py on the same machine.

    python benchmarks/adaptive.py                     # 3 rounds
    python benchmarks/adaptive.py --only finetune --rounds 5
Writes benchmarks/results/adaptive.json and .md (see --out).
"""
import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import ROOT, cpu_name, write_report  # noqa: E402  (benchmarks/harness.py)
from run import WORKLOADS, Workload  # noqa: E402  (benchmarks/run.py)

BEFORE = os.path.join(ROOT, "benchmarks", "results", "evaluation.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "adaptive"))
    args = ap.parse_args()
    with open(BEFORE) as f:
        before = json.load(f)["workloads"]
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-adaptive-")
    report = {"command": "python benchmarks/adaptive.py " + " ".join(sys.argv[1:]),
              "machine": f"{cpu_name()}, {os.cpu_count()} cores", "rounds": args.rounds,
              "workloads": {}}
    try:
        for name in args.only.split(","):
            w = Workload(name, WORKLOADS[name], False, work)
            w.config("plain")  # warm-up: page cache
            warm = w.fresh_store("warm")
            w.run([sys.executable, "-m", "flor", "record", os.path.basename(w.script), *w.args],
                  env={"FLOR_DIR": warm})
            w.calibration = os.path.join(warm, "calibration.json")
            raw = {"plain": [], "flor": []}
            for r in range(args.rounds):
                order = list(raw)
                rng.shuffle(order)
                for cfg in order:
                    res = w.config(cfg)
                    store = res.pop("store", None)
                    if store:
                        shutil.rmtree(store, ignore_errors=True)
                    raw[cfg].append(res)
                    print(f"{name} round {r} {cfg}: {res['seconds']:.1f} s "
                          f"{res.get('checkpoints', '')}", file=sys.stderr, flush=True)
            plain = statistics.median(x["seconds"] for x in raw["plain"])
            flor = statistics.median(x["seconds"] for x in raw["flor"])
            old = before[name]["configs"]
            report["workloads"][name] = {
                "title": WORKLOADS[name]["title"], "args": w.args, "plain_s": plain,
                "flor_s": flor, "overhead": flor / plain - 1,
                "checkpoints": [x["checkpoints"] for x in raw["flor"]],
                "iterations": int(w.args[w.args.index("--epochs") + 1]),
                "before": {"overhead": old["flor"]["overhead"],
                           "checkpoints": old["flor"]["checkpoints"]},
                "raw": raw}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(report, args.out, render)


def render(report):
    lines = [f"Machine: {report['machine']}.  Command: `{report['command'].strip()}`; "
             f"{report['rounds']} interleaved rounds, medians.  Before: the rule charging the "
             "whole background write (benchmarks/results/evaluation.json).", "",
             "| workload | epochs | checkpoints before | overhead before | checkpoints now "
             "(per round) | overhead now |", "|---|---|---|---|---|---|"]
    for name, r in report["workloads"].items():
        lines.append(f"| {r['title']} | {r['iterations']} | {r['before']['checkpoints']} | "
                     f"{100 * r['before']['overhead']:+.1f}% | "
                     f"{', '.join(map(str, r['checkpoints']))} | {100 * r['overhead']:+.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
