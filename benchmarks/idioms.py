"""Hindsight on real training-script idioms: is an epoch-loop probe faster than
re-training, and does it print what re-training prints?

The scripts are benchmarks/workloads' idiom scripts (gradient accumulation
with the step outside the inner loop, helpers that print, a recursive pure
helper, a trainer class, a print-heavy loop), recorded hands-free with the
adaptive rule.  A statement is added to the epoch loop (the one
tests/test_idioms.py adds); then each round runs the edited script plain
(re-training) and `python -m flor replay` of it, in a shuffled order.
Reported: medians over rounds, the speedup (plain / replay), and whether
replay's stdout equals the plain run's (clock fields masked) with the
deferred checks passing.

    python benchmarks/idioms.py                       # 3 rounds
    python benchmarks/idioms.py --only word_lm.py --rounds 1
Writes benchmarks/results/idioms.json and .md (see --out).
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cpu_name, script_env, write_report  # noqa: E402  (benchmarks/harness.py)

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")

# script: (args, (epoch anchor, statement)): the statements of tests/test_idioms.py
CASES = {
    "gpt_accum.py": (["--max-iters", "40", "--accum", "4"],
                     ("optimizer.zero_grad(set_to_none=True)",
                      'print(f"  wnorm {sum(p.norm() ** 2 for p in model.parameters())'
                      '.item() ** 0.5:.6f}")')),
    "mnist_helpers.py": (["--epochs", "4"],
                         ("scheduler.step()",
                          'print(f"  wnorm {model.fc2.weight.norm().item():.6f}")')),
    "word_lm.py": (["--epochs", "4"],
                   ("val_loss = evaluate(val_data)",
                    'print(f"  wnorm {model.decoder.weight.norm().item():.6f}")')),
    "trainer_class.py": (["--epochs", "6"],
                         ('self.history["val_acc"].append(val_acc)',
                          'print(f"  wnorm {self.model.head.weight.norm().item():.6f}")')),
    "print_heavy.py": (["--epochs", "20", "--steps", "5000"],
                       ("lr *= 0.9", 'print(f"  w {w:.6f} b {b:.6f}")')),
}
CLOCK = re.compile(r"(time [0-9.]+ms|ms/batch +[0-9.]+|time: +[0-9.]+s)")


def _run(argv, cwd, env):
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dt, proc


def _edit(path, anchor, line):
    with open(path) as f:
        src = f.read().splitlines(keepends=True)
    i = next(i for i, l in enumerate(src) if anchor in l)
    indent = src[i][: len(src[i]) - len(src[i].lstrip())]
    src.insert(i + 1, indent + line + "\n")
    with open(path, "w") as f:
        f.write("".join(src))


def bench(name, rounds, work, rng):
    args, (anchor, stmt) = CASES[name]
    d = os.path.join(work, name[:-3])
    os.makedirs(d)
    path = os.path.join(d, name)
    shutil.copy(os.path.join(WORKLOADS, name), path)
    env = script_env(os.path.join(d, ".flor"))
    _run([sys.executable, name, *args], d, env)  # warm-up: page cache, bytecode
    record_s, rec = _run([sys.executable, "-m", "flor", "record", name, *args], d, env)
    ckpts = re.search(r"(\d+) checkpoints", rec.stderr)
    _edit(path, anchor, stmt)
    raw = {"plain": [], "replay": []}
    outs = {}
    for _ in range(rounds):
        order = list(raw)
        rng.shuffle(order)
        for kind in order:
            argv = [sys.executable, name, *args] if kind == "plain" else \
                [sys.executable, "-m", "flor", "replay", name, *args]
            dt, proc = _run(argv, d, env)
            raw[kind].append(dt)
            outs[kind] = proc
    plain, replay = statistics.median(raw["plain"]), statistics.median(raw["replay"])
    same = CLOCK.sub("<clock>", outs["plain"].stdout) == CLOCK.sub("<clock>",
                                                                   outs["replay"].stdout)
    return {"args": args, "record_s": record_s,
            "checkpoints": int(ckpts.group(1)) if ckpts else None,
            "plain_s": plain, "replay_s": replay, "speedup": plain / replay,
            "stdout_equal": same,
            "checks_passed": "deferred checks passed" in outs["replay"].stderr,
            "raw": raw}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "idioms"))
    args = ap.parse_args()
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-idioms-")
    report = {"command": ("python benchmarks/idioms.py " + " ".join(sys.argv[1:])).strip(),
              "machine": f"{cpu_name()}, {os.cpu_count()} cores", "rounds": args.rounds,
              "scripts": {}}
    try:
        for name in args.only.split(","):
            report["scripts"][name] = r = bench(name, args.rounds, work, rng)
            print(f"{name}: {r['speedup']:.1f}x, stdout equal {r['stdout_equal']}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_report(report, args.out, render)


def render(report):
    lines = [f"Machine: {report['machine']}, one torch thread.  Command: `{report['command']}`; "
             f"{report['rounds']} interleaved rounds, medians.", "",
             "| script | arguments | checkpoints | re-train (s) | epoch-probe replay (s) | "
             "speedup | stdout = re-train | checks |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["scripts"].items():
        lines.append(f"| {name} | `{' '.join(r['args'])}` | {r['checkpoints']} | "
                     f"{r['plain_s']:.2f} | {r['replay_s']:.2f} | {r['speedup']:.1f}x | "
                     f"{'yes' if r['stdout_equal'] else 'NO'} | "
                     f"{'passed' if r['checks_passed'] else 'FAILED'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
