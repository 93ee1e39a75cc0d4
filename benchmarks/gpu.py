"""The CUDA path: what a checkpoint of GPU state costs training.

State: layers of 4096x4096 float32 parameters with AdamW's two moments, all
on the GPU, sized to about --gib GiB each.  A training step is a forward
and backward pass of a --batch x 4096 batch and an AdamW step.  In one
process, per round and in a shuffled order:

  blocking  the training thread's time in the call, and the time until the
            copy has landed in host memory (its throughput against a pinned
            copy_, the device-to-host limit):
              pinned    a copy_ of every tensor into a preallocated pinned
                        buffer, then torch.cuda.synchronize()
              staged    flor.snapshot(state) with FLOR_CUDA_COPY=staged
              ordered   flor.snapshot(state) with FLOR_CUDA_COPY=ordered
              submit    flor.Materializer(mode="thread").submit(state) (auto)
              dcp       torch.distributed.checkpoint.async_save, staging
                        included (when this torch runs it without a process group)
  next step the time of the training step that follows the checkpoint,
            against a step that follows none:
              sync      the pinned copy (the copy waited for, as flor did
                        before the copy stream)
              staged, ordered   flor.snapshot in that mode
              lazy      DataStates-LLM's order, written here with torch's
                        API: the copy runs on a side stream while the
                        forward and backward passes run, and the step waits
                        for it only before the optimizer updates the state
                        in place (safe only where the training loop is
                        known: nothing else updates the state before that)

and, once, a state fingerprint (version 2, on the device; version 1,
through a host copy) and the time to restore the state onto the GPU
(flor.load(..., map_location="cuda") of a written checkpoint).

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
from flor import _core  # noqa: E402
from harness import write_report  # noqa: E402

MiB = 1 << 20
WIDTH = 4096


def make_state(gib):
    n = max(1, round(gib * (1 << 30) / (3 * WIDTH * WIDTH * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(n)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, WIDTH, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    return model, opt


def tensors(model, opt):
    out = [p.data for p in model.parameters()]
    for s in opt.state.values():
        out += [v for v in s.values() if torch.is_tensor(v) and v.is_cuda]
    return out


def med(xs):
    return statistics.median(xs)


def copy_mode(mode):
    os.environ["FLOR_CUDA_COPY"] = mode


class Bench:
    def __init__(self, gib, batch, work):
        self.model, self.opt = make_state(gib)
        self.ts = tensors(self.model, self.opt)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.ts)
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.x = torch.randn(batch, WIDTH, device="cuda")
        self.state = {"model": self.model, "opt": self.opt}
        self.side = torch.cuda.Stream()
        self.mat = flor.Materializer(os.path.join(work, "m"), mode="thread",
                                     max_buffer_bytes=2 * self.nbytes + MiB)
        self.count = 0
        self.last = None

    def step(self, before_update=None):
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        if before_update is not None:
            before_update()
        self.opt.step()

    def pinned(self):
        """The copy of every tensor into the pinned buffer, waited for."""
        off = 0
        for t in self.ts:
            b = t.numel() * t.element_size()
            self.host[off:off + b].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            off += b
        torch.cuda.synchronize()

    def lazy(self):
        """The copy on the side stream; returns the step's hook that makes
        the training stream wait for it before the update."""
        self.side.wait_stream(torch.cuda.current_stream())
        done = torch.cuda.Event()
        with torch.cuda.stream(self.side):
            off = 0
            for t in self.ts:
                b = t.numel() * t.element_size()
                self.host[off:off + b].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                off += b
            done.record(self.side)
        return lambda: torch.cuda.current_stream().wait_event(done)

    def submit(self):
        self.count += 1
        self.last = f"c{self.count}"
        self.mat.submit(self.last, self.state)

    def blocking(self, fn):
        """(seconds in the call, seconds until the copy has landed)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kept = fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()  # every stream of the device, flor's copy stream too
        t2 = time.perf_counter()
        del kept
        return t1 - t0, t2 - t0

    def next_step(self, kind):
        """The step after a checkpoint of `kind` (None: after none)."""
        torch.cuda.synchronize()
        hook, kept = None, None
        if kind == "sync":
            self.pinned()
        elif kind == "lazy":
            hook = self.lazy()
        elif kind in ("staged", "ordered"):
            copy_mode(kind)
            kept = flor.snapshot(self.state)
        t0 = time.perf_counter()
        self.step(hook)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del kept
        return dt


def measure(gib, batch, rounds, work, dcp_on):
    b = Bench(gib, batch, work)
    calls = {"pinned": b.pinned, "submit": b.submit,
             "staged": lambda: (copy_mode("staged"), flor.snapshot(b.state))[1],
             "ordered": lambda: (copy_mode("ordered"), flor.snapshot(b.state))[1]}
    dcp_error, pending = None, []
    if dcp_on:
        try:
            import torch.distributed.checkpoint as dcp

            def dcp_save():
                b.count += 1
                pending.append(dcp.async_save(
                    {"model": b.model.state_dict(), "opt": b.opt.state_dict()},
                    checkpoint_id=os.path.join(work, f"dcp{b.count}")))
            dcp_save()
            pending.pop().result()
            calls["dcp"] = dcp_save
        except Exception as e:  # reported in the table, not hidden
            dcp_error = f"{type(e).__name__}: {e}"[:200]
    steps = [None, "sync", "staged", "ordered", "lazy"]
    for fn in calls.values():  # warm-up
        b.blocking(fn)
    for k in steps:
        b.next_step(k)
    b.mat.flush()
    for f in pending:
        f.result()
    pending.clear()
    block = {k: [] for k in calls}
    landed = {k: [] for k in calls}
    step = {str(k): [] for k in steps}
    for _ in range(rounds):
        order = list(calls) + [("step", k) for k in steps]
        random.shuffle(order)
        for k in order:
            if isinstance(k, tuple):
                step[str(k[1])].append(b.next_step(k[1]))
                continue
            copy_mode("auto")
            t_call, t_landed = b.blocking(calls[k])
            block[k].append(t_call)
            landed[k].append(t_landed)
            b.mat.flush()
            for f in pending:
                f.result()
            pending.clear()
    copy_mode("auto")
    fps = {}
    for version in (2, 1):
        _core.fingerprint(b.state, version)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            _core.fingerprint(b.state, version)
            times.append(time.perf_counter() - t)
        fps[f"v{version}"] = med(times)
    b.mat.close()
    name = os.path.join(work, "m", b.last + ".flor")
    loads = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        flor.load(name, map_location="cuda")
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - t)
    base = med(step["None"])
    return {"gib": gib, "bytes": b.nbytes, "tensors": len(b.ts), "batch": batch,
            "block_s": {k: med(v) for k, v in block.items()},
            "landed_s": {k: med(v) for k, v in landed.items()},
            "step_s": {k: med(v) for k, v in step.items()},
            "slowdown": {k: med(v) / base - 1 for k, v in step.items() if k != "None"},
            "samples": {"block_s": block, "landed_s": landed, "step_s": step},
            "fingerprint_s": fps, "restore_s": med(loads), "dcp_error": dcp_error}


def render(rep):
    lines = [f"Command: `{rep['command']}`  ", f"GPU: {rep['gpu']}, torch {rep['torch']}  ",
             f"Medians of {rep['rounds']} interleaved rounds.", "",
             "Training thread's time in the call (and until the copy has landed in host "
             "memory):", "",
             "| state | pinned copy_ (limit) | snapshot, staged | snapshot, ordered "
             "| Materializer.submit | dcp.async_save | staged per GiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def ms(s):
        return f"{s * 1e3:.2f} ms" if s < 0.01 else f"{s * 1e3:.0f} ms"

    for r in rep["results"]:
        bl, la, gib = r["block_s"], r["landed_s"], r["bytes"] / (1 << 30)
        cell = {k: f"{ms(bl[k])} ({ms(la[k])})" for k in bl}
        lines.append(f"| {r['bytes'] / MiB:.0f} MiB, {r['tensors']} tensors | {ms(bl['pinned'])} "
                     f"| {cell['staged']} | {cell['ordered']} | {cell['submit']} "
                     f"| {cell.get('dcp', 'n/a')} | {ms(bl['staged'] / gib)} |")
    lines += ["", "The training step after a checkpoint, against one after none:", "",
              "| state, batch | step | after sync copy | after staged | after ordered "
              "| after lazy (DataStates-LLM order) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rep["results"]:
        st, sl = r["step_s"], r["slowdown"]
        cells = " | ".join(f"{ms(st[k])} ({100 * sl[k]:+.1f}%)"
                           for k in ("sync", "staged", "ordered", "lazy"))
        lines.append(f"| {r['bytes'] / MiB:.0f} MiB, {r['batch']} | {ms(st['None'])} | {cells} |")
    lines += ["", "| state | fingerprint v2 (on the GPU) | v1 (host copy) "
              "| restore onto the GPU |", "|---|---:|---:|---:|"]
    for r in rep["results"]:
        f = r["fingerprint_s"]
        lines.append(f"| {r['bytes'] / MiB:.0f} MiB | {ms(f['v2'])} | {ms(f['v1'])} "
                     f"| {ms(r['restore_s'])} |")
    errs = [r["dcp_error"] for r in rep["results"] if r["dcp_error"]]
    if errs:
        lines += ["", f"dcp.async_save could not run here: {errs[0]}"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1, 4])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-dcp", action="store_true", help="leave out dcp.async_save")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device")
    work = tempfile.mkdtemp(prefix="flor-gpu-")
    try:
        results = [measure(g, args.batch, args.rounds, work, not args.no_dcp) for g in args.gib]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rep = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rounds": args.rounds, "results": results}
    write_report(rep, args.out, render)


if __name__ == "__main__":
    main()
