"""Is hindsight logging cheaper than re-training, on the shapes real training
scripts have?  For each workload script, recorded hands-free:

  record overhead  `python script.py` against `python -m flor record`
  outer probe      a statement in the main loop (an epoch loop, or a step
                   loop whose training step is inline), replayed with
                   --jobs 1, against a plain run of the edited script
  inner probe      a statement in the training step, replayed with --jobs 2
                   (the planner starts the workers that pay: the table says how many)
                   (on a step loop with no nested loop every step runs
                   again, and only the workers can make it faster)

Each round runs every command once, in a shuffled order; the report gives
medians, plain / replay (the speed-up), and whether every replay printed
exactly what the plain run of its edited script printed (clock fields
masked) with the deferred checks passing.

A workload is a script of benchmarks/workloads, or a project there
(``project_trainer/train.py``: its directory, whose training loop is in its
own modules, where its probes go too).

    python benchmarks/real_scripts.py                 # 3 rounds
    python benchmarks/real_scripts.py --only lbfgs_sine.py --rounds 1
Writes benchmarks/results/real-scripts.json and .md (see --out).
"""
import argparse
import os
import random
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (ROOT, add_line, header_line, load_average, median, report_header,  # noqa: E402
                     script_env, timed, write_report)

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")
WNORM = 'print(f"  wnorm {sum(p.norm() ** 2 for p in %s.parameters()).item() ** 0.5:.6f}")'
GNORM = ('print(f"  gnorm {sum(p.grad.norm() ** 2 for p in %s.parameters() '
         'if p.grad is not None).item() ** 0.5:.6f}")')

# script: (arguments, (outer anchor, statement), (inner anchor, statement))
CASES = {
    "gpt_accum.py": (["--max-iters", "120", "--accum", "4", "--log-interval", "10"],
                     ("optimizer.zero_grad(set_to_none=True)", WNORM % "model"),
                     ("loss.backward()", GNORM % "model")),
    "makemore_steps.py": (["--max-steps", "12000"],
                          ("optimizer.step()", WNORM % "model"),
                          ("loss.backward()", GNORM % "model")),
    "mnist_helpers.py": (["--epochs", "14"],
                         ("scheduler.step()", WNORM % "model"),
                         ("loss.backward()", GNORM % "model")),
    "gan_digits.py": (["--epochs", "40"],
                      ('print(f"epoch {epoch} sample', WNORM % "netG"),
                      ("errG.backward()", GNORM % "netG")),
    "lbfgs_sine.py": (["--steps", "6"],
                      ('print("test loss:"', WNORM % "seq"),
                      ("loss.backward()", GNORM % "seq")),
    # Lightning: the outer probe in on_train_epoch_end, the inner one in
    # training_step (before the step's backward: its loss)
    "lightning_digits.py": (["--epochs", "12", "--repeat", "4", "--width", "256",
                             "--patience", "20"],
                            ("self.step_losses.clear()", WNORM % "self"),
                            ("self.step_losses.append(loss.detach())",
                             'print(f"  loss {loss.item():.6f}")')),
    # Accelerate: the outer probe after the epoch's accelerator.print, the
    # inner one after the step's accelerator.backward
    "accelerate_digits.py": (["--epochs", "20", "--width", "4096", "--batch-size", "4"],
                             ('accelerator.print(f"epoch', WNORM % "model"),
                             ("accelerator.backward(loss)", GNORM % "model")),
    # The Hugging Face Trainer: the outer probe in a callback's on_epoch_end,
    # the inner one in the Trainer subclass's compute_loss
    "hf_digits.py": (["--epochs", "8"],
                     ('print(f"epoch {state.epoch:.0f}', WNORM % "kwargs['model']"),
                     ("loss = F.cross_entropy(", 'print(f"  loss {loss.item():.6f}")')),
    # The project's own modules: a directory whose train.py is the script;
    # the training loop is in mylib/trainer.py, and both probes too (a
    # probe is (file, anchor, statement) where it is not in the script)
    "project_trainer/train.py": (["--epochs", "8", "--width", "64"],
                                 ("mylib/trainer.py", "self.accuracies.append(accuracy)",
                                  WNORM % "self.model"),
                                 ("mylib/trainer.py", "loss.backward()",
                                  GNORM % "self.model")),
}
CLOCK = re.compile(r"(time [0-9.]+m?s|ms/batch +[0-9.]+|time: +[0-9.]+s"
                   r"|'\w+_(?:runtime|per_second)': '?[0-9.e+-]+'?)")


def _read(path):
    with open(path) as f:
        return f.read()


def _write(d, sources, edit=None):
    """The project's files as written, with `edit` ((file, text)) applied."""
    for f, text in sources.items():
        with open(os.path.join(d, f), "w") as out:
            out.write(edit[1] if edit is not None and edit[0] == f else text)


def bench(name, rounds, work, rng):
    args, outer, inner = CASES[name]
    project, _, name = name.rpartition("/")
    d = os.path.join(work, project or name[:-3])
    if project:  # the project's directory, the script in it
        shutil.copytree(os.path.join(WORKLOADS, project), d,
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        os.makedirs(d)
        shutil.copy(os.path.join(WORKLOADS, name), d)
    env = script_env(os.path.join(d, ".flor"))
    probes = {"outer": outer, "inner": inner}
    where = {kind: p[0] if len(p) == 3 else name for kind, p in probes.items()}
    sources = {f: _read(os.path.join(d, f)) for f in {name, *where.values()}}
    edited = {kind: add_line(sources[where[kind]], *probes[kind][-2:]) for kind in probes}
    for kind, text in edited.items():
        assert text != sources[where[kind]], f"{name}: no line holds the {kind} anchor"
    # One record, then each round: plain and record of the original, plain
    # and replay of each edit.  A later record is the one replayed: every
    # replay in a round replays the round's own record.
    outer, inner = (where["outer"], edited["outer"]), (where["inner"], edited["inner"])
    commands = {
        "plain": ([sys.executable, name, *args], None),
        "record": ([sys.executable, "-m", "flor", "record", name, *args], None),
        "outer_plain": ([sys.executable, name, *args], outer),
        "outer_replay": ([sys.executable, "-m", "flor", "replay", name, *args], outer),
        "inner_plain": ([sys.executable, name, *args], inner),
        "inner_replay": ([sys.executable, "-m", "flor", "replay", "--jobs", "2", name, *args],
                         inner),
    }
    raw = {k: [] for k in commands}
    outs, stderr = {}, {}
    timed([sys.executable, name, *args], d, env)  # warm-up: page cache, bytecode
    for _ in range(rounds):
        order = ["record"] + rng.sample([k for k in commands if k != "record"],
                                        len(commands) - 1)
        for kind in order:
            argv, change = commands[kind]
            _write(d, sources, change)
            dt, proc = timed(argv, d, env)
            raw[kind].append(dt)
            outs[kind] = CLOCK.sub("<clock>", proc.stdout)
            stderr[kind] = proc.stderr
    ckpts = re.search(r"(\d+) checkpoints \(([0-9.]+) MiB\) and (\d+) iteration checkpoints "
                      r"\(([0-9.]+) MiB\)", stderr["record"])
    med = {k: median(v) for k, v in raw.items()}
    result = {"args": args, "median_s": med, "raw_s": raw,
              "record_overhead": med["record"] / med["plain"] - 1,
              "checkpoints": ckpts.groups() if ckpts else None}
    for probe in ("outer", "inner"):
        result[probe] = {
            "speedup": med[f"{probe}_plain"] / med[f"{probe}_replay"],
            "stdout_equal": outs[f"{probe}_plain"] == outs[f"{probe}_replay"],
            "checks_passed": "deferred checks passed" in stderr[f"{probe}_replay"],
            "segments": (re.findall(r"in segments (.*)", stderr[f"{probe}_replay"]) or [""])[0],
            "workers": int((re.findall(r"iterations, (\d+) workers?", stderr[f"{probe}_replay"])
                            or [0])[0]),
            "notes": [l for l in stderr[f"{probe}_replay"].splitlines()
                      if l.startswith("flor:") and ("faster" in l or "worker" in l)]}
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "real-scripts"))
    args = ap.parse_args()
    rng = random.Random(0)
    work = tempfile.mkdtemp(prefix="flor-real-")
    report = dict(report_header("real_scripts.py", args.rounds), scripts={})
    try:
        for name in args.only.split(","):
            report["scripts"][name] = r = bench(name, args.rounds, work, rng)
            print(f"{name}: record {r['record_overhead']:+.1%}, outer "
                  f"{r['outer']['speedup']:.2f}x, inner --jobs 2 {r['inner']['speedup']:.2f}x",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_after"] = load_average()
    write_report(report, args.out, render)


def render(report):
    lines = [header_line(report) + (
                 ", medians.  Speed-up: a plain run of the edited script / its replay."), "",
             "| script | arguments | plain (s) | record | checkpoints (MiB), iteration (MiB) | "
             "outer probe, 1 worker | inner probe, --jobs 2 (workers started) | "
             "output = plain, checks |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in report["scripts"].items():
        c = r["checkpoints"]
        same = all(r[p]["stdout_equal"] and r[p]["checks_passed"] for p in ("outer", "inner"))
        lines.append(
            f"| {name} | `{' '.join(r['args'])}` | {r['median_s']['plain']:.1f} | "
            f"{r['record_overhead']:+.1%} | "
            f"{f'{c[0]} ({c[1]}), {c[2]} ({c[3]})' if c else '?'} | "
            f"{r['outer']['speedup']:.2f}x | {r['inner']['speedup']:.2f}x"
            f"{' (%d)' % r['inner']['workers'] if r['inner'].get('workers') else ''} | "
            f"{'yes' if same else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
