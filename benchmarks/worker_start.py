"""What a replay worker's start costs, spawned and forked from the fork
server (flor/replay/forkserver.py).

For each workload script, recorded hands-free once, an epoch-loop probe is
replayed three ways: on 1 worker; on 2 workers (2 segments); and in 4
segments queued on 2 workers (FLOR_SEGMENTS).  Each way runs with
FLOR_FORKSERVER=0 (every worker started afresh: the interpreter, flor, the
script's imports) and with the server (its imports go on while replay
plans; the workers are forked from it).  Rounds interleave every command in
a shuffled order; the report gives medians and the seconds the server saved.

    python benchmarks/worker_start.py                  # 3 rounds
    python benchmarks/worker_start.py --rounds 1 --only mnist_helpers.py
Writes benchmarks/results/worker-start.json and .md (see --out).
"""
import argparse
import os
import random
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (ROOT, add_line, header_line, load_average, median, open_store,  # noqa: E402
                     report_header, script_env, timed, write_report)

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")
WNORM = 'print(f"  wnorm {sum(p.norm() ** 2 for p in %s.parameters()).item() ** 0.5:.6f}")'

# script: (arguments, anchor of the epoch-loop probe, its statement, 4 segment starts)
CASES = {
    "mnist_helpers.py": (["--epochs", "4"], "scheduler.step()", WNORM % "model", "0,1,2,3"),
    "gan_digits.py": (["--epochs", "8"], 'print(f"epoch {epoch} sample', WNORM % "netG",
                      "0,2,4,6"),
}
WAYS = {  # way: (--jobs, FLOR_SEGMENTS or None for the planner's)
    "1 worker": ("1", None),
    "2 workers": ("2", "two"),
    "4 segments, 2 workers": ("2", "four"),
}


def bench(name, rounds, work, rng):
    args, anchor, line, four = CASES[name]
    with open(os.path.join(WORKLOADS, name)) as f:
        original = f.read()
    d = os.path.join(work, name[:-3])
    os.makedirs(d)
    env = script_env(os.path.join(d, ".flor"))
    with open(os.path.join(d, name), "w") as f:
        f.write(original)
    timed([sys.executable, name, *args], d, env)  # warm-up: page cache, bytecode
    timed([sys.executable, "-m", "flor", "record", name, *args], d, env)
    with open(os.path.join(d, name), "w") as f:
        f.write(add_line(original, anchor, line))
    starts = {"two": four.split(",")[0] + "," + four.split(",")[2], "four": four}
    store = open_store(os.path.join(d, ".flor"))
    raw = {(way, server): [] for way in WAYS for server in ("spawned", "forked")}
    forked = {}
    for _ in range(rounds):
        for way, server in rng.sample(list(raw), len(raw)):
            jobs, segments = WAYS[way]
            run_env = dict(env, FLOR_ALL_JOBS="1",
                           FLOR_FORKSERVER="1" if server == "forked" else "0")
            if segments:
                run_env["FLOR_SEGMENTS"] = starts[segments]
            dt, proc = timed([sys.executable, "-m", "flor", "replay", "--jobs", jobs, name,
                              *args], d, run_env)
            if "deferred checks passed" not in proc.stderr:
                sys.exit(f"{name} {way} {server}: the checks did not pass\n{proc.stderr}")
            raw[(way, server)].append(dt)
            last = [r for r in store.runs() if r["kind"] == "replay"][-1]
            forked[(way, server)] = last["info"].forked
    return {"args": args, "ways": {
        way: {"spawned_s": median(raw[(way, "spawned")]), "forked_s": median(raw[(way, "forked")]),
              "raw_spawned_s": raw[(way, "spawned")], "raw_forked_s": raw[(way, "forked")],
              "workers_forked": forked[(way, "forked")],
              "workers_spawned": forked[(way, "spawned")]}
        for way in WAYS}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "worker-start"))
    args = ap.parse_args()
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-start-")
    report = dict(report_header("worker_start.py", args.rounds), scripts={})
    try:
        for name in args.only.split(","):
            report["scripts"][name] = bench(name, args.rounds, work, rng)
            print(f"{name} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_after"] = load_average()
    write_report(report, args.out, render)


def render(report):
    lines = [header_line(report) + (
                 ", medians of an epoch-loop probe's replay, from the command's start."), "",
             "| script | arguments | replay | spawned (s) | forked (s) | saved (s) | "
             "workers forked |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["scripts"].items():
        for way, w in r["ways"].items():
            lines.append(f"| {name} | `{' '.join(r['args'])}` | {way} | {w['spawned_s']:.2f} | "
                         f"{w['forked_s']:.2f} | {w['spawned_s'] - w['forked_s']:+.2f} | "
                         f"{w['workers_forked']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
