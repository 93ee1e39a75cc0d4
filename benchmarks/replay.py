"""What record costs and what replay saves, on examples/train_digits.py.

In one run, on a copy of the example in a temporary directory:

  record overhead   `python train.py` with flor off (FLOR_MODE=off) against
                    `python -m flor record train.py`, interleaved, medians
  epoch-loop probe  a statement added to the epoch loop, replayed with
                    --jobs 1, against a full re-run (the plain run's time).
                    ideal = full run / (restore + outer-loop time), where the
                    restore time is what the replay's SkipBlocks spent loading
                    and restoring checkpoints, and the outer-loop time is a
                    record run's time minus its own training-block compute
                    (process start, imports, data, evaluation)
  inner-loop probe  a statement added to the training loop, replayed with
                    --jobs 1 and --jobs 2 back to back in each round; each
                    process runs torch with one thread; efficiency = median
                    over rounds of T1 / (2 T2)

Times are wall-clock seconds of whole commands, as a user sees them.

    python benchmarks/replay.py                  # 20 epochs, 3 rounds
Writes bench-results/replay.json and .md (see --out).
"""
import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, add_line, cpu_name, median, write_report  # noqa: E402  (benchmarks/harness.py)
EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
INNER = ("loss.backward()",
         'flor.log("grad_norm", sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5)')
OUTER = ('flor.log("val_acc", val_acc)',
         'flor.log("weight_norm", {n: p.norm() for n, p in model.named_parameters() '
         'if n.endswith("weight")})')


class Bench:
    def __init__(self, work, args, example=EXAMPLE):
        self.work, self.args = work, args
        self.env = dict(os.environ, FLOR_DIR=os.path.join(work, ".flor"),
                        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.env.pop("FLOR_MODE", None)
        self.script = os.path.join(work, "train.py")
        with open(example) as f:
            self.original = f.read()
        self.write(self.original)

    def write(self, source):
        with open(self.script, "w") as f:
            f.write(source)

    def run(self, argv, env=None):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=self.work, env=dict(self.env, **(env or {})),
                              capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}")
        return dt, proc

    def plain(self):
        return self.run([sys.executable, "train.py", *self.args], env={"FLOR_MODE": "off"})[0]

    def record(self):
        return self.run([sys.executable, "-m", "flor", "record", "train.py", *self.args])[0]

    def replay(self, jobs, *options):
        return self.run([sys.executable, "-m", "flor", "replay", "--jobs", str(jobs), *options,
                         "train.py", *self.args])

    def store(self):
        sys.path.insert(0, ROOT)
        from flor.store import Store

        return Store(os.path.join(self.work, ".flor"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-results/replay")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="flor-bench-replay-")
    b = Bench(work, ["--epochs", str(args.epochs), "--threads", "1"])
    try:
        # Warm the page cache and the bandwidth calibration.
        b.plain()
        b.record()
        st = b.store()
        plain, record, outer_loop = [], [], []
        for r in range(args.rounds):
            for kind in (("plain", "record") if r % 2 == 0 else ("record", "plain")):
                if kind == "plain":
                    plain.append(b.plain())
                    print(f"round {r} plain: {plain[-1]:.2f} s", file=sys.stderr)
                    continue
                record.append(b.record())
                rec = [x for x in st.runs() if x["kind"] == "record"][-1]
                compute = sum(x["compute_s"] for x in st.rows("blocks", rec["run_id"]))
                # Everything but the training blocks, measured in the same process.
                outer_loop.append(record[-1] - compute)
                print(f"round {r} record: {record[-1]:.2f} s (blocks {compute:.2f} s)",
                      file=sys.stderr)
        ckpts = [d for d in st.rows("decisions", rec["run_id"]) if d["checkpoint"]]

        # Epoch-loop probe: every block skipped.
        b.write(add_line(b.original, *OUTER))
        outer_times, restores = [], []
        for r in range(args.rounds):
            dt, _ = b.replay(1)
            rep = [x for x in st.runs() if x["kind"] == "replay"][-1]
            restores.append(sum(x["restore_s"] for x in st.rows("blocks", rep["run_id"])))
            outer_times.append(dt)
            print(f"round {r} epoch-loop probe: {dt:.2f} s (restore {restores[-1]:.2f} s)",
                  file=sys.stderr)

        # Inner-loop probe: serial and parallel, interleaved.
        b.write(add_line(b.original, *INNER))
        t1, t2 = [], []
        for r in range(args.rounds):
            for jobs in ((1, 2) if r % 2 == 0 else (2, 1)):
                dt, proc = b.replay(jobs)
                if "deferred checks passed" not in proc.stderr:
                    sys.exit(f"deferred checks failed:\n{proc.stderr}")
                (t1 if jobs == 1 else t2).append(dt)
                print(f"round {r} inner-loop probe --jobs {jobs}: {dt:.2f} s", file=sys.stderr)
        b.write(b.original)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    full = median(plain)
    restore = median(restores)
    ideal = full / (restore + median(outer_loop))
    speedup = full / median(outer_times)
    # Each round ran --jobs 1 and --jobs 2 back to back: pair them.
    efficiency = median([a / (2 * b) for a, b in zip(t1, t2)])
    report = {
        "command": "python benchmarks/replay.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release()},
        "epochs": args.epochs, "rounds": args.rounds,
        "plain_s": plain, "record_s": record,
        "record_overhead": median(record) / full - 1,
        "checkpoints": len(ckpts),
        "checkpoint_bytes": sum(d["nbytes"] for d in ckpts),
        "outer_probe_s": outer_times, "restore_s": restores,
        "outer_loop_s": outer_loop, "ideal_speedup": ideal, "outer_probe_speedup": speedup,
        "fraction_of_ideal": speedup / ideal,
        "inner_jobs1_s": t1, "inner_jobs2_s": t2, "parallel_efficiency": efficiency,
        "targets": {
            "epoch-loop probe >= 0.8 x ideal speedup": speedup / ideal >= 0.8,
            "inner-loop probe, 2 workers: efficiency >= 85%": efficiency >= 0.85,
        },
    }
    write_report(report, args.out, render)


def render(r):
    m = median
    return "\n".join([
        f"Command: `{r['command'].strip()}`  ",
        f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, Python "
        f"{r['machine']['python']}; examples/train_digits.py, {r['epochs']} epochs, one torch "
        f"thread per process; medians of {r['rounds']} interleaved rounds of whole commands.",
        "",
        "| measurement | time | against |",
        "|---|---:|---|",
        f"| plain run (`FLOR_MODE=off python train.py`) | {m(r['plain_s']):.2f} s | |",
        f"| record (`python -m flor record train.py`) | {m(r['record_s']):.2f} s | "
        f"{100 * r['record_overhead']:+.1f}% overhead, {r['checkpoints']} checkpoints of "
        f"{r['checkpoint_bytes'] / r['checkpoints'] / 2**20:.1f} MiB |",
        f"| epoch-loop probe, `--jobs 1` | {m(r['outer_probe_s']):.2f} s | "
        f"{r['outer_probe_speedup']:.1f}x faster than a full run; ideal {r['ideal_speedup']:.1f}x "
        f"= {m(r['plain_s']):.2f} / ({m(r['restore_s']):.2f} restore + "
        f"{m(r['outer_loop_s']):.2f} outer loop); {100 * r['fraction_of_ideal']:.0f}% of ideal |",
        f"| inner-loop probe, `--jobs 1` | {m(r['inner_jobs1_s']):.2f} s | |",
        f"| inner-loop probe, `--jobs 2` | {m(r['inner_jobs2_s']):.2f} s | "
        f"parallel efficiency {100 * r['parallel_efficiency']:.0f}% (median over rounds of "
        f"T1 / 2 T2) |",
        "",
        "| target | met |", "|---|:---:|",
        *(f"| {k} | {'yes' if v else 'NO'} |" for k, v in r["targets"].items()),
        "",
    ])


if __name__ == "__main__":
    main()
