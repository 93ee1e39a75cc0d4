"""What record costs and what replay saves for a training loop on the GPU.

The workload is benchmarks/workloads/gpt_accum.py with --device cuda: a
small GPT trained the way nanoGPT's train.py does it (gradient accumulation,
AdamW, clipping, periodic evaluation), recorded hands-free (the script does
not import flor).  In one run, on a copy of it in a temporary directory:

  record overhead   `python train.py` against `python -m flor record
                    train.py`, interleaved, medians of --rounds
  hindsight probe   the gradient norm printed after clipping, in the main
                    loop (every accumulation loop is skipped, its side
                    effects, gradients included, restored onto the GPU),
                    replayed with --jobs 1, against the plain run's time;
                    on the GPU with --tolerance 1e-3 (its kernels are not
                    deterministic, so re-executed iterations come out near
                    the record's, not equal)

Times are wall-clock seconds of whole commands, process start and CUDA
initialisation included, as a user sees them.

    python benchmarks/gpu_record.py --rounds 2
Writes benchmarks/results/gpu_record.json and .md (see --out).
"""
import argparse
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from materialize import write_report  # noqa: E402
from replay import Bench, _cpu, add_line  # noqa: E402

SCRIPT = os.path.join(HERE, "workloads", "gpt_accum.py")
PROBE = ("torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
         'print(f"hindsight grad norm {sum(float(p.grad.norm()) ** 2 for p in '
         'model.parameters() if p.grad is not None) ** 0.5:.6f}")')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu only to try the benchmark itself")
    ap.add_argument("--script-args", default="--max-iters 40 --accum 4 --batch-size 32 "
                    "--block-size 256 --n-layer 8 --n-embd 512 --eval-interval 20 "
                    "--log-interval 20", help="gpt_accum.py's arguments (--device is added)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_record"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="flor-bench-gpu-record-")
    script_args = args.script_args.split() + ["--device", args.device]
    b = Bench(work, script_args, example=SCRIPT)
    try:
        b.plain()  # warm the page cache, the kernels' caches and the calibration
        plain, record = [], []
        for r in range(args.rounds):
            for kind in (("plain", "record") if r % 2 == 0 else ("record", "plain")):
                (plain if kind == "plain" else record).append(getattr(b, kind)())
                print(f"round {r} {kind}: {(plain if kind == 'plain' else record)[-1]:.2f} s",
                      file=sys.stderr)
        st = b.store()
        rec = [x for x in st.runs() if x["kind"] == "record"][-1]
        decisions = st.rows("decisions", rec["run_id"])
        ckpts = [d for d in decisions if d["checkpoint"]]
        fingerprints = sum(1 for x in st.logs(rec["run_id"]) if x["name"] == "state@iteration")
        b.write(add_line(b.original, *PROBE))
        # GPU kernels (the embedding's backward, cuBLAS) are not deterministic
        # unless the script asks torch for deterministic algorithms: the
        # iterations replay runs again come out near the record's, not equal.
        tolerance = ["--tolerance", "1e-3"] if args.device == "cuda" else []
        replay, proc = b.replay(1, *tolerance)
        if "deferred checks passed" not in proc.stderr:
            sys.exit(f"deferred checks failed:\n{proc.stderr}")
        checks = next(x for x in proc.stderr.splitlines() if "deferred checks passed" in x)
        probed = proc.stdout.count("hindsight grad norm")
        print(f"replay: {replay:.2f} s, {probed} values", file=sys.stderr)
        rep = [x for x in st.runs() if x["kind"] == "replay"][-1]
        restore = sum(x["restore_s"] for x in st.rows("blocks", rep["run_id"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import torch

    report = {
        "command": "python benchmarks/gpu_record.py " + shlex.join(sys.argv[1:]),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none"},
        "script_args": script_args, "rounds": args.rounds,
        "plain_s": plain, "record_s": record,
        "record_overhead": statistics.median(record) / statistics.median(plain) - 1,
        "executions": len(decisions), "checkpoints": len(ckpts),
        "iterations": rec["iterations"], "state_fingerprints": fingerprints,
        "replay_options": tolerance, "checks": checks.removeprefix("flor: "),
        "checkpoint_bytes": sum(d["nbytes"] for d in ckpts),
        "replay_s": replay, "restore_s": restore, "probed_values": probed,
        "replay_speedup": statistics.median(plain) / replay,
    }
    write_report(report, args.out, render)


def render(r):
    m = statistics.median
    ck = r["checkpoints"]
    size = f" of {r['checkpoint_bytes'] / ck / 2**20:.1f} MiB" if ck else ""
    return "\n".join([
        f"Command: `{r['command'].strip()}`  ",
        f"Machine: {r['machine']['gpu']}, {r['machine']['cpu']}, {r['machine']['cores']} cores, "
        f"Python {r['machine']['python']}, torch {r['machine']['torch']}; "
        f"benchmarks/workloads/gpt_accum.py `{' '.join(r['script_args'])}`; medians of "
        f"{r['rounds']} interleaved rounds of whole commands.",
        "",
        "| measurement | time | against |",
        "|---|---:|---|",
        f"| plain run (`python train.py`) | {m(r['plain_s']):.2f} s | |",
        f"| record (`python -m flor record train.py`) | {m(r['record_s']):.2f} s | "
        f"{100 * r['record_overhead']:+.1f}% overhead; {ck} checkpoints{size} in "
        f"{r['executions']} block executions |",
        f"| hindsight gradient norm, replay `--jobs 1` | {r['replay_s']:.2f} s | "
        f"{r['replay_speedup']:.2f}x the plain run's speed; {r['probed_values']} values; "
        f"{r['restore_s']:.2f} s restoring |",
        "",
        f"The record fingerprinted the training state at {r['state_fingerprints']} of its "
        f"{r['iterations']} iterations. Replay `{' '.join(r['replay_options']) or '(exact)'}`: "
        f"{r['checks']}",
        "",
    ])


if __name__ == "__main__":
    main()
