"""The CUDA path: how long a checkpoint of GPU state holds up training.

State: layers of 4096x4096 float32 parameters with AdamW's two moments, all
on the GPU, sized to about --gib GiB each.  In one process, per round and in
a shuffled order, the training thread's blocking time of:

  pinned    a copy_ of every tensor into one preallocated pinned host buffer,
            then torch.cuda.synchronize() (the device-to-host limit)
  snapshot  flor.snapshot(state): copies into flor's pinned staging arena
  submit    flor.Materializer(mode="thread").submit(state): the snapshot plus
            queueing the background write (the write itself is not timed)
  dcp       torch.distributed.checkpoint.async_save (staging included), when
            this torch can run it without a process group

and, once, the time to restore the skipped state onto the GPU
(flor.load(..., map_location="cuda") of the written checkpoint).

    python benchmarks/gpu.py --gib 1 4 --rounds 5
Writes benchmarks/results/gpu.json and .md (see --out).
"""
import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import flor  # noqa: E402
from materialize import write_report  # noqa: E402

MiB = 1 << 20


def make_state(gib):
    n = max(1, round(gib * (1 << 30) / (3 * 4096 * 4096 * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(n)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    return model, opt


def tensors(model, opt):
    out = [p.data for p in model.parameters()]
    for s in opt.state.values():
        out += [v for v in s.values() if torch.is_tensor(v) and v.is_cuda]
    return out


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(gib, rounds, work):
    model, opt = make_state(gib)
    ts = tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pinned():
        off = 0
        for t in ts:
            b = t.numel() * t.element_size()
            host[off:off + b].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            off += b
        torch.cuda.synchronize()

    mat = flor.Materializer(os.path.join(work, "m"), mode="thread", max_buffer_bytes=2 * nbytes + MiB)
    state = {"model": model, "opt": opt}
    count = [0]
    last = []

    def submit():
        count[0] += 1
        last.append(f"c{count[0]}")
        mat.submit(last[-1], state)

    configs = {"pinned": pinned, "snapshot": lambda: flor.snapshot(state), "submit": submit}
    try:
        import torch.distributed.checkpoint as dcp

        def dcp_save():
            count[0] += 1
            fut = dcp.async_save({"model": model.state_dict(), "opt": opt.state_dict()},
                                 checkpoint_id=os.path.join(work, f"dcp{count[0]}"))
            dcp_save.pending.append(fut)
        dcp_save.pending = []
        dcp_save()
        for f in dcp_save.pending:
            f.result()
        configs["dcp"] = dcp_save
        dcp_error = None
    except Exception as e:  # reported in the table, not hidden
        dcp_error = f"{type(e).__name__}: {e}"[:200]
    for fn in configs.values():  # warm-up
        fn()
    mat.flush()
    samples = {k: [] for k in configs}
    for _ in range(rounds):
        order = list(configs)
        random.shuffle(order)
        for k in order:
            samples[k].append(timed(configs[k]))
            mat.flush()
            if k == "dcp":
                for f in dcp_save.pending:
                    f.result()
                dcp_save.pending.clear()
    mat.close()
    name = os.path.join(work, "m", last[-1] + ".flor")
    loads = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        flor.load(name, map_location="cuda")
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"gib": gib, "bytes": nbytes, "tensors": len(ts), "median_s": med, "samples_s": samples,
            "restore_s": statistics.median(loads), "dcp_error": dcp_error,
            "throughput_vs_pinned": {k: med["pinned"] / v for k, v in med.items()}}


def render(rep):
    lines = [f"Command: `{rep['command']}`  ", f"GPU: {rep['gpu']}, torch {rep['torch']}  ",
             f"Medians of {rep['rounds']} interleaved rounds (blocking time of the training thread).", "",
             "| state | pinned copy_ | flor.snapshot | Materializer.submit | dcp.async_save "
             "| submit vs pinned (throughput) | restore onto GPU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rep["results"]:
        m = r["median_s"]
        dcp = f"{m['dcp'] * 1e3:.0f} ms" if "dcp" in m else "n/a"
        lines.append(f"| {r['bytes'] / MiB:.0f} MiB, {r['tensors']} tensors | {m['pinned'] * 1e3:.0f} ms "
                     f"| {m['snapshot'] * 1e3:.0f} ms | {m['submit'] * 1e3:.0f} ms | {dcp} "
                     f"| {r['throughput_vs_pinned']['submit']:.2f}x | {r['restore_s'] * 1e3:.0f} ms |")
    errs = [r["dcp_error"] for r in rep["results"] if r["dcp_error"]]
    if errs:
        lines += ["", f"dcp.async_save could not run here: {errs[0]}"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device")
    work = tempfile.mkdtemp(prefix="flor-gpu-")
    try:
        results = [measure(g, args.rounds, work) for g in args.gib]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rep = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rounds": args.rounds, "results": results}
    write_report(rep, args.out, render)


if __name__ == "__main__":
    main()
