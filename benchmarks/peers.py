"""flor's checkpoints side by side with the checkpointers people use.

Same states, one run, every method in its own worker process (built the same
way), interleaved: each round visits the methods in a new random order.  The
report gives medians over rounds.

States
  model-S     real nn.Modules (CNN and transformer blocks) plus torch.optim.Adam
              after one step, S bytes of float32 in all (--sizes, MiB)
  finetune    a frozen backbone (the same modules, requires_grad False) and a
              trained head with its AdamW state; each round takes 5
              checkpoints in a row, the head changing between them

Methods
  flor thread, flor fork   flor.Materializer (incremental, as flor's record
                           uses it), submit() then flush()
  torch.save               inline, then fsync
  dcp.save, dcp.async_save torch.distributed.checkpoint, single process
  checkfreq                the CheckFreq design: copy into a preallocated
                           buffer, then torch.save + fsync in a thread
  memcpy                   limit: a memcpy of S bytes into a warm buffer
  write+fsync              limit: one sequential write of S bytes from a warm
                           buffer, then fsync

Figures per checkpoint: block (seconds the training thread is inside the
call), durable (call until fsync'd), the next step's slowdown (an in-place
update of every trained tensor, while any background write goes on; against
the same step after torch.save), peak extra memory (AnonPages of the
machine, sampled every ms), bytes written, and for the three file formats a
cold load + restore: the files are evicted from the page cache
(posix_fadvise DONTNEED), then flor.load / torch.load(mmap=True) /
dcp.load, and load_state_dict into the live model and optimizer.

    python benchmarks/peers.py                       # S = 270 and 1024 MiB
    python benchmarks/peers.py --sizes 64 --rounds 2 # quick
Writes bench-results/peers.json and .md (see --out).
"""
import argparse
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import torch

import flor
from flor import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine, median, write_report  # noqa: E402  (benchmarks/harness.py)
from materialize import (Sampler, build_state, fsync_path, state_nbytes,  # noqa: E402
                         warm_buffers)

MiB = 1 << 20
METHODS = ["flor thread", "flor fork", "torch.save", "dcp.save", "dcp.async_save", "checkfreq",
           "memcpy", "write+fsync"]
FINETUNE_CHECKPOINTS = 5


def _files(path):
    if os.path.isdir(path):
        return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    return [path] if os.path.exists(path) else []


def _evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Method:
    """One way of checkpointing `plain` (state dicts) / `obj` (live objects)."""

    def __init__(self, name, workdir, nbytes):
        self.name, self.workdir, self.n = name, workdir, 0
        self.mat = self.pending = self.buffer = self.dir = None
        if name in ("memcpy", "write+fsync"):
            self.src, self.dst = warm_buffers(nbytes)

    def new_run(self):
        """A fresh run directory (flor: a fresh incremental index); the last
        one is removed."""
        if self.pending is not None:
            self.pending.join()
        if self.mat is not None:
            self.mat.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = tempfile.mkdtemp(dir=self.workdir)
        if self.name.startswith("flor"):
            self.mat = flor.Materializer(self.dir, mode=self.name.split()[1],
                                         max_buffer_bytes=4 << 30, batch_count=1,
                                         incremental=True)

    def save(self, obj, plain):
        """Returns (path, wait): wait() returns once the checkpoint is durable."""
        self.n += 1
        path = os.path.join(self.dir, f"ck{self.n}")
        if self.mat is not None:
            self.mat.submit(f"ck{self.n}", obj)
            return path + ".flor", self.mat.flush
        if self.name == "torch.save":
            torch.save(plain, path)
            fsync_path(path)
        elif self.name == "dcp.save":
            import torch.distributed.checkpoint as dcp
            dcp.save(plain, checkpoint_id=path)
        elif self.name == "dcp.async_save":
            import torch.distributed.checkpoint as dcp
            fut = dcp.async_save(plain, checkpoint_id=path)
            return path, fut.result
        elif self.name == "checkfreq":
            if self.pending is not None:
                self.pending.join()  # one snapshot in flight, as CheckFreq
            if self.buffer is None:
                self.buffer = _clone(plain)
            _copy_into(self.buffer, plain)
            buf = self.buffer

            def write():
                torch.save(buf, path)
                fsync_path(path)
            self.pending = threading.Thread(target=write)
            self.pending.start()
            return path, self.pending.join
        elif self.name == "memcpy":
            np.copyto(self.dst, self.src)
            return None, lambda: None
        elif self.name == "write+fsync":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                mv = memoryview(self.src)
                done = 0
                while done < len(mv):
                    done += os.write(fd, mv[done:done + (64 << 20)])
                os.fsync(fd)
            finally:
                os.close(fd)
        return path, lambda: None

    def load(self, path, model, opt, backbone=None):
        """Cold load + restore into the live objects; returns seconds."""
        if self.name not in ("flor thread", "torch.save", "dcp.save") or path is None:
            return float("nan")
        _evict(_files(path))
        t0 = time.perf_counter()
        if self.name == "flor thread":
            sd = flor.load(path)
            _restore(sd, model, opt, backbone)
        elif self.name == "torch.save":
            sd = torch.load(path, mmap=True, weights_only=True)
            _restore(sd, model, opt, backbone)
        else:
            import torch.distributed.checkpoint as dcp
            sd = _plain(model, opt, backbone)
            dcp.load(sd, checkpoint_id=path)  # in place, into the live tensors
            opt.load_state_dict(sd["optimizer"])
        return time.perf_counter() - t0

    def close(self):
        if self.pending is not None:
            self.pending.join()
        if self.mat is not None:
            self.mat.close()


def _clone(sd):
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone(v) for v in sd]
    return sd


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            if isinstance(dst[k], (torch.Tensor, dict, list)):
                _copy_into(dst[k], src[k])
            else:
                dst[k] = src[k]
    elif isinstance(dst, list):
        for i in range(len(dst)):
            if isinstance(dst[i], (torch.Tensor, dict, list)):
                _copy_into(dst[i], src[i])
            else:
                dst[i] = src[i]


def _plain(model, opt, backbone=None):
    out = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if backbone is not None:
        out["backbone"] = backbone.state_dict()
    return out


def _restore(sd, model, opt, backbone):
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    if backbone is not None:
        backbone.load_state_dict(sd["backbone"])


def build_finetune(size_bytes):
    """A frozen backbone of about size_bytes and a trained head of 8 MiB of
    parameters (Linear 2048 -> 1024) with AdamW."""
    backbone, _ = build_state(size_bytes * 3)  # its parameters alone: size_bytes
    backbone = backbone.requires_grad_(False)
    torch.manual_seed(1)
    head = torch.nn.Linear(2048, 1024)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    for p in head.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    for p in head.parameters():
        p.grad = None
    return backbone, head, opt


def worker(conn, workload, size_mib, method, args):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="torch.distributed")
    workdir = tempfile.mkdtemp(prefix="flor-peers-", dir=args.dir)
    backbone = None
    if workload == "finetune":
        backbone, model, opt = build_finetune(int(size_mib * MiB))
        nbytes = state_nbytes(model, opt)[0] + sum(t.numel() * t.element_size()
                                                   for t in backbone.state_dict().values())
    else:
        model, opt = build_state(int(size_mib * MiB))
        nbytes = state_nbytes(model, opt)[0]
    def step():
        # The trained tensors, looked up each time: a load replaces the
        # optimizer's state tensors with the loaded ones.
        tensors = [p for p in model.parameters()] + \
            [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        with torch.no_grad():
            torch._foreach_add_(tensors, 1e-6)

    def objects():
        obj = {"model": model, "optimizer": opt}
        if backbone is not None:
            obj["backbone"] = backbone
        return obj

    m = Method(method, workdir, nbytes)
    conn.send(("ready", nbytes))
    while conn.recv() == "run":
        retained = _core.pool_stats()["free_bytes"] if m.mat is not None else \
            (m.dst.nbytes if method == "memcpy" else 0)
        m.new_run()
        conn.send("mark")
        conn.recv()
        out = []
        for _ in range(FINETUNE_CHECKPOINTS if workload == "finetune" else 1):
            t0 = time.perf_counter()
            path, wait = m.save(objects(), _plain(model, opt, backbone))
            t1 = time.perf_counter()
            step()
            t2 = time.perf_counter()
            wait()
            t3 = time.perf_counter()
            out.append({"block": t1 - t0, "step": t2 - t1, "durable": t3 - t0,
                        "bytes": sum(os.path.getsize(p) for p in _files(path)) if path else 0,
                        "path": path})
        r = {"block": median([x["block"] for x in out]), "step": median([x["step"] for x in out]),
             "durable": median([x["durable"] for x in out]),
             "bytes": sum(x["bytes"] for x in out), "retained": retained}
        conn.send(r)
        conn.recv()  # the memory sample is taken: now the load
        conn.send(m.load(out[-1]["path"], model, opt, backbone))
    m.close()
    shutil.rmtree(workdir, ignore_errors=True)


class Worker:
    def __init__(self, workload, size, method, args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, workload, size, method, args))
        self.proc.start()
        child.close()

    def ready(self):
        tag, self.nbytes = self.conn.recv()
        assert tag == "ready"

    def run(self, sampler):
        self.conn.send("run")
        assert self.conn.recv() == "mark"
        base = sampler.ask("mark")
        self.conn.send("go")
        r = self.conn.recv()
        peak = sampler.ask("peak")
        r["extra"] = max(0, peak - base) + r.pop("retained")
        self.conn.send("load")
        r["load"] = self.conn.recv()
        return r

    def close(self):
        self.conn.send("stop")
        self.proc.join(timeout=300)


def measure(workload, size, args, sampler, rng):
    workers = {m: Worker(workload, size, m, args) for m in METHODS}
    for w in workers.values():
        w.ready()
    nbytes = next(iter(workers.values())).nbytes
    samples = {m: [] for m in METHODS}
    try:
        for rnd in range(args.rounds + 1):
            order = METHODS[:]
            rng.shuffle(order)
            for m in order:
                r = workers[m].run(sampler)
                if rnd:
                    samples[m].append(r)
                print(f"{workload} {size:g} MiB round {rnd} {m:14s} block {r['block'] * 1e3:8.1f} ms"
                      f"  durable {r['durable'] * 1e3:8.1f} ms  extra {r['extra'] / MiB:7.0f} MiB"
                      f"  bytes {r['bytes'] / MiB:8.1f} MiB  load {r['load'] * 1e3:7.1f} ms",
                      file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    base_step = median([r["step"] for r in samples["torch.save"]])
    summary = {}
    for m, rs in samples.items():
        summary[m] = {"block_s": median([r["block"] for r in rs]),
                      "durable_s": median([r["durable"] for r in rs]),
                      "step_slowdown": median([r["step"] for r in rs]) / base_step - 1,
                      "extra_bytes": max(r["extra"] for r in rs),
                      "bytes_written": median([r["bytes"] for r in rs]),
                      "load_s": median([r["load"] for r in rs])}
    return {"workload": workload, "size_mib": size, "state_bytes": nbytes,
            "summary": summary, "samples": samples}


def paired(rs_a, rs_b, f, key="block"):
    return median([f(a[key], b[key]) for a, b in zip(rs_a, rs_b)])


def targets(res, finetune):
    out = {}
    ms = 1e-3
    for r in res:
        s = r["samples"]
        tag = f"{r['size_mib']:g} MiB"
        out[f"blocking <= 1.5 x memcpy + 5 ms ({tag})"] = {
            "measured": paired(s["flor thread"], s["memcpy"], lambda f, m: f / (1.5 * m + 5 * ms)),
            "limit": 1.0, "unit": "of the limit"}
        peers = ["torch.save", "dcp.save", "dcp.async_save", "checkfreq"]
        out[f"blocking <= every peer's ({tag})"] = {
            "measured": max(paired(s["flor thread"], s[p], lambda f, q: f / q) for p in peers),
            "limit": 1.0, "unit": "x the least-blocking peer"}
        out[f"durable <= 1.2 x write+fsync ({tag})"] = {
            "measured": paired(s["flor thread"], s["write+fsync"], lambda f, w: f / w,
                               key="durable"),
            "limit": 1.2, "unit": "x"}
        out[f"cold load + restore <= torch.load(mmap=True) + load_state_dict ({tag})"] = {
            "measured": paired(s["flor thread"], s["torch.save"], lambda f, t: f / t, key="load"),
            "limit": 1.0, "unit": "x"}
    if finetune is not None:
        s = finetune["summary"]["flor thread"]
        changed = finetune["changed_bytes"]
        out["fine-tuning: bytes written <= 1.2 x changed bytes"] = {
            "measured": s["bytes_written"] / changed, "limit": 1.2, "unit": "x"}
        out["fine-tuning: peak extra memory <= 2.2 x the state"] = {
            "measured": s["extra_bytes"] / finetune["state_bytes"], "limit": 2.2, "unit": "x"}
    for v in out.values():
        v["met"] = v["measured"] <= v["limit"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="270,1024", help="model+Adam states, MiB, comma-separated")
    ap.add_argument("--finetune-mib", type=float, default=256, help="frozen backbone, MiB")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    ap.add_argument("--out", default="bench-results/peers", help="output path without suffix")
    ap.add_argument("--dir", default=None, help="where checkpoints are written")
    args = ap.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    rng = random.Random(0)
    sampler = Sampler()
    try:
        results = [measure("model", float(s), args, sampler, rng) for s in args.sizes.split(",")]
        finetune = measure("finetune", args.finetune_mib, args, sampler, rng)
    finally:
        sampler.close()
    # Changed bytes over the 5 checkpoints: the whole state once, then the
    # head and its optimizer state each time.
    _, head, opt = build_finetune(MiB)
    trained = state_nbytes(head, opt)[0]
    finetune["trained_bytes"] = trained
    finetune["changed_bytes"] = finetune["state_bytes"] + (FINETUNE_CHECKPOINTS - 1) * trained
    report = {"command": "python benchmarks/peers.py " + " ".join(sys.argv[1:]),
              "machine": machine(torch), "rounds": args.rounds, "results": results,
              "finetune": finetune, "targets": targets(results, finetune)}
    write_report(report, args.out, render)


def render(rep):
    mc = rep["machine"]
    lines = [f"Command: `{rep['command'].strip()}`  ",
             f"Machine: {mc['cpu']}, {mc['cores']} cores, {mc['memory_gib']} GiB, Python "
             f"{mc['python']}, torch {mc['torch']}, GPU: {mc['cuda'] or 'none'}  ",
             f"Medians of {rep['rounds']} interleaved rounds after a warm-up round.", ""]
    for r in rep["results"] + [rep["finetune"]]:
        S = r["state_bytes"]
        if r["workload"] == "finetune":
            title = (f"**Fine-tuning: frozen backbone + trained head, {S / MiB:.0f} MiB, "
                     f"{FINETUNE_CHECKPOINTS} checkpoints in a row** (block, durable and "
                     "load: medians per checkpoint; bytes: the 5 together; changed bytes: "
                     f"{r['changed_bytes'] / MiB:.0f} MiB)")
        else:
            title = f"**Model + Adam, S = {S / MiB:.0f} MiB**"
        lines += [title, "", "| method | blocks training | durable after | next step | "
                  "peak extra memory | bytes written | cold load + restore |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for m, s in r["summary"].items():
            load = "" if s["load_s"] != s["load_s"] else f"{s['load_s'] * 1e3:.0f} ms"
            lines.append(f"| {m} | {s['block_s'] * 1e3:.1f} ms | {s['durable_s'] * 1e3:.0f} ms | "
                         f"{s['step_slowdown'] * 100:+.0f}% | {s['extra_bytes'] / MiB:.0f} MiB "
                         f"({s['extra_bytes'] / S:.2f} S) | {s['bytes_written'] / MiB:.1f} MiB | "
                         f"{load} |")
        lines.append("")
    lines += ["**Goals** (flor thread; ratios are medians over rounds of the two methods "
              "measured in the same round)", "", "| goal | measured | limit | met |",
              "|---|---:|---:|:---:|"]
    for k, v in rep["targets"].items():
        lines.append(f"| {k} | {v['measured']:.2f} {v['unit']} | {v['limit']:g} | "
                     f"{'yes' if v['met'] else 'NO'} |")
    if not rep["machine"]["cuda"]:
        lines += ["", "No GPU on this machine: the GPU figures were not measured."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
