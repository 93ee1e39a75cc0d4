"""How long does a checkpoint stop training, and what does it cost afterwards?

Two workloads, each checkpointed by every method, interleaved (the order is
shuffled in every round) and repeated: in each round every method takes
three checkpoints and the round keeps their median; the report gives the
median over rounds.  Each
method runs in its own worker process, built identically: a method that
forks (flor fork, the Queue's writer) splits its process's huge pages on
copy-on-write, which would slow every later copy in a shared process.

  state   a model's and Adam's state: real nn.Modules (small-CNN and small-
          transformer blocks) plus a real torch.optim.Adam after one step,
          S bytes of float32 in all (default 256 MiB)
  python  a dict of 10^6 small lists (the seed report's Plasma comparison)

Methods: the lower bound (memcpy of S bytes into a warm buffer), torch.save,
cloudpickle.dump, a multiprocessing.Queue to a writer process, and
flor.Materializer in inline, thread and fork mode.

For each checkpoint we measure
  block    seconds the training thread is inside the checkpoint call;
  step     seconds of one training step run right after it, while any
           background write goes on: an in-place update of every tensor (or
           every list); compared with the same step after torch.save (inline,
           nothing left running), it shows writer CPU and GIL contention and
           fork copy-on-write faults;
  durable  seconds from the call until the file is fsync'd (the step runs
           in between for background methods);
  memory   peak extra anonymous memory of the whole machine (AnonPages in
           /proc/meminfo, sampled every millisecond by a separate process),
           plus buffers a method keeps between checkpoints (flor's warm
           staging pool, the memcpy target).  It sees copy-on-write copies in
           forked children that no per-process RSS shows.

    python benchmarks/materialize.py                 # S = 256 MiB, 5 rounds x 3
    python benchmarks/materialize.py --size-mib 64 --rounds 3 --objects 200000
Writes bench-results/materialize.json and .md (see --out).
"""
import argparse
import json
import multiprocessing as mp
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time

import cloudpickle
import numpy as np
import torch
from torch import nn

import flor
from flor import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine, median, write_report  # noqa: E402  (benchmarks/harness.py)

MiB = 1 << 20

# ---------------------------------------------------------------- workloads


class CNNBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)


class TransformerBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 8)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def build_state(size_bytes):
    """Modules and Adam state totalling about size_bytes (params are a third)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.Embedding(8000, 384)])
    widths = [64, 128, 256]
    i = 0
    while sum(p.numel() for p in blocks.parameters()) * 4 * 3 < size_bytes:
        blocks.append(CNNBlock(widths[i % 3]) if i % 2 == 0 else TransformerBlock(384))
        i += 1
    opt = torch.optim.Adam(blocks.parameters(), lr=1e-3)
    for p in blocks.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    for p in blocks.parameters():
        p.grad = None
    return blocks, opt


def state_nbytes(model, opt):
    ts = list(model.state_dict().values())
    for s in opt.state.values():
        ts += [v for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in ts), len(ts)


# ---------------------------------------------------------------- memory sampler

SAMPLER = r"""
import select, sys
def anon():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonPages:"):
                return int(line.split()[1]) * 1024
peak = anon()
while True:
    r, _, _ = select.select([sys.stdin], [], [], 0.001)
    if r:
        cmd = sys.stdin.readline().strip()
        if not cmd:
            break
        now = anon()
        if cmd == "mark":
            peak = now
        print(max(peak, now), flush=True)
    else:
        peak = max(peak, anon())
"""


class Sampler:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SAMPLER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ask(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


# ---------------------------------------------------------------- queue writer


def queue_writer(q, acks):
    while True:
        item = q.get()
        if item is None:
            return
        path, data = item
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        acks.put(path)


# ---------------------------------------------------------------- methods


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def warm_buffers(nbytes):
    """Source and target of the memcpy bound: anonymous maps kept out of forked
    children (like flor's staging buffers), touched once so they are warm."""
    import mmap

    bufs = []
    for _ in range(2):
        m = mmap.mmap(-1, max(nbytes, 1))
        for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
            if hasattr(mmap, advice):
                m.madvise(getattr(mmap, advice))
        a = np.frombuffer(m, np.uint8)
        a[:] = 1
        bufs.append(a)
    return bufs


def worker(conn, workload, method, args):
    """Builds one workload and checkpoints it with one method, on request."""
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="flor-bench-", dir=args.dir)
    if workload == "state":
        model, opt = build_state(int(args.size_mib * MiB))
        obj = {"model": model, "optimizer": opt}
        plain = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        nbytes, _ = state_nbytes(model, opt)
        tensors = list(model.parameters()) + [v for st in opt.state.values() for v in st.values()
                                              if torch.is_tensor(v) and v.dim() > 0]

        def step():
            with torch.no_grad():
                torch._foreach_add_(tensors, 0.0)
    else:
        obj = plain = {i: [i, i + 1, i + 2] for i in range(args.objects)}
        nbytes = 0

        def step():
            for v in obj.values():
                v[0] = v[0]

    path = os.path.join(workdir, "ckpt")
    q = acks = writer = mat = None
    src = dst = None
    if method == "memcpy":
        src, dst = warm_buffers(nbytes)
    elif method == "mp.Queue":
        ctx = mp.get_context("fork")
        q, acks = ctx.Queue(), ctx.Queue()
        writer = ctx.Process(target=queue_writer, args=(q, acks), daemon=True)
        writer.start()
    elif method.startswith("flor"):
        mat = flor.Materializer(workdir, mode=method.split()[1], max_buffer_bytes=4 << 30,
                                batch_count=1)
    conn.send("ready")
    while conn.recv() == "run":
        retained = 0
        if mat is not None:
            retained = _core.pool_stats()["free_bytes"]
        elif method == "memcpy":
            retained = dst.nbytes
        conn.send("mark")
        conn.recv()
        t0 = time.perf_counter()
        if method == "memcpy":
            np.copyto(dst, src)
        elif method == "torch.save":
            torch.save(plain, path)
        elif method == "cloudpickle":
            with open(path, "wb") as f:
                cloudpickle.dump(plain, f, protocol=5)
        elif method == "mp.Queue":
            q.put((path, pickle.dumps(plain, protocol=5)))
        else:
            mat.submit("ckpt", obj)
        t1 = time.perf_counter()
        if method in ("torch.save", "cloudpickle"):
            fsync_path(path)
        t_inline = time.perf_counter()
        step()
        t2 = time.perf_counter()
        if q is not None:
            acks.get()
        elif mat is not None:
            mat.flush()
        t3 = time.perf_counter()
        if method == "memcpy":
            durable = float("nan")
        elif q is not None or mat is not None:
            durable = t3 - t0
        else:
            durable = t_inline - t0
        conn.send({"block": t1 - t0, "step": t2 - t_inline, "durable": durable,
                   "retained": retained})
    if mat is not None:
        mat.close()
    if q is not None:
        q.put(None)
        writer.join(timeout=60)
    shutil.rmtree(workdir, ignore_errors=True)


class Worker:
    def __init__(self, workload, method, args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, workload, method, args))
        self.proc.start()
        child.close()

    def ready(self):
        assert self.conn.recv() == "ready"

    def run(self, sampler):
        self.conn.send("run")
        assert self.conn.recv() == "mark"
        base = sampler.ask("mark")
        self.conn.send("go")
        r = self.conn.recv()
        peak = sampler.ask("peak")
        r["extra"] = max(0, peak - base) + r.pop("retained")
        return r

    def close(self):
        self.conn.send("stop")
        self.proc.join(timeout=120)


# ---------------------------------------------------------------- driver


def gpu_throughput(size_bytes, rounds):
    """flor.snapshot of GPU state vs a pinned copy_ of the same bytes."""
    if not torch.cuda.is_available():
        return None
    model, opt = build_state(size_bytes)
    model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    nbytes, _ = state_nbytes(model, opt)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    state = {"model": model, "optimizer": opt}
    flor.snapshot(state)
    snap_t, copy_t = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s = flor.snapshot(state)
        snap_t.append(time.perf_counter() - t0)
        del s
    return {"bytes": nbytes, "snapshot_s": median(snap_t), "pinned_copy_s": median(copy_t),
            "fraction": median(copy_t) / median(snap_t),
            "snapshot_gbps": nbytes / median(snap_t) / 1e9,
            "pinned_copy_gbps": nbytes / median(copy_t) / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=256, help="S: bytes of model+Adam state (MiB)")
    ap.add_argument("--objects", type=int, default=1_000_000, help="lists in the Python workload")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up)")
    ap.add_argument("--per-round", type=int, default=3,
                    help="checkpoints per method in each round; the round keeps their median")
    ap.add_argument("--out", default="bench-results/materialize", help="output path without suffix")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of an earlier run")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            md = render(json.load(f))
        with open(args.render[: -len(".json")] + ".md", "w") as f:
            f.write(md)
        print(md)
        return

    torch.set_num_threads(1)
    model, opt = build_state(int(args.size_mib * MiB))
    nbytes, ntensors = state_nbytes(model, opt)
    del model, opt
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    methods = {
        "state": ["memcpy", "torch.save", "cloudpickle", "mp.Queue", "flor inline", "flor thread",
                  "flor fork"],
        "python": ["torch.save", "cloudpickle", "mp.Queue", "flor inline", "flor thread",
                   "flor fork"],
    }
    sampler = Sampler()
    workers = {(w, m): Worker(w, m, args) for w, ms in methods.items() for m in ms}
    for wk in workers.values():
        wk.ready()
    results = {w: {m: [] for m in ms} for w, ms in methods.items()}
    cold = {}
    rng = random.Random(0)
    try:
        for rnd in range(args.rounds + 1):
            for w in ("state", "python"):
                order = methods[w][:]
                rng.shuffle(order)
                for m in order:
                    if rnd == 0:
                        # first use: fresh memory, imports
                        cold[f"{w}/{m}"] = r = workers[(w, m)].run(sampler)
                    else:
                        runs = [workers[(w, m)].run(sampler) for _ in range(args.per_round)]
                        r = {k: median([x[k] for x in runs]) for k in ("block", "step", "durable")}
                        r["extra"] = max(x["extra"] for x in runs)
                        r["runs"] = runs
                        results[w][m].append(r)
                    print(f"round {rnd} {w:6s} {m:12s} block {r['block'] * 1e3:8.1f} ms  "
                          f"step {r['step'] * 1e3:7.1f} ms  durable {r['durable'] * 1e3:8.1f} ms  "
                          f"extra {r['extra'] / MiB:7.1f} MiB", file=sys.stderr)
    finally:
        for wk in workers.values():
            wk.close()
        sampler.close()

    summary = {}
    for w, per in results.items():
        # A step after an inline checkpoint, with nothing in the background.
        base_step = median([r["step"] for r in per["torch.save"]])
        summary[w] = {}
        for m, rs in per.items():
            summary[w][m] = {
                "block_s": median([r["block"] for r in rs]),
                "block_spread_s": [min(r["block"] for r in rs), max(r["block"] for r in rs)],
                "step_s": median([r["step"] for r in rs]),
                "block_plus_step_s": median([r["block"] + r["step"] for r in rs]),
                "step_slowdown": median([r["step"] for r in rs]) / base_step - 1,
                "durable_s": median([r["durable"] for r in rs]),
                "durable_spread_s": [min(r["durable"] for r in rs), max(r["durable"] for r in rs)],
                "extra_bytes": max(r["extra"] for r in rs),
            }
    default = "flor " + flor.materializer.DEFAULT_MODE
    st, py = results["state"], results["python"]

    def paired(a, b, f):
        """Median over rounds of f(a's sample, b's sample): each pair was taken
        seconds apart in one round, so machine noise largely cancels."""
        return median([f(x["block"], y["block"]) for x, y in zip(a, b)])

    ms = 1e-3
    verdicts = {
        "default blocks <= 1.5 x memcpy + 5 ms (state)": {
            "measured": paired(st[default], st["memcpy"], lambda f, m: f / (1.5 * m + 5 * ms)),
            "limit": 1.0, "unit": "fraction of the round's limit"},
        "default blocks >= 8x less than torch.save (state)": {
            "measured": paired(st["torch.save"], st[default], lambda t, f: t / f),
            "limit": 8.0, "unit": "x", "at_least": True},
        "default blocks <= 0.5 x cloudpickle (python)": {
            "measured": paired(py[default], py["cloudpickle"], lambda f, c: f / c),
            "limit": 0.5, "unit": "x"},
        "default peak extra memory <= 2.2 x S (state)": {
            "measured": max(r["extra"] for r in st[default]) / nbytes,
            "limit": 2.2, "unit": "S (max over rounds)"},
    }
    for v in verdicts.values():
        v["met"] = v["measured"] >= v["limit"] if v.get("at_least") else v["measured"] <= v["limit"]
    gpu = gpu_throughput(int(args.size_mib * MiB), args.rounds)
    if gpu is not None:
        verdicts["GPU snapshot >= 0.8 x pinned copy_ throughput"] = {
            "measured": gpu["fraction"], "limit": 0.8, "unit": "x", "at_least": True,
            "met": gpu["fraction"] >= 0.8}
    report = {
        "command": "python benchmarks/materialize.py " + " ".join(sys.argv[1:]),
        "machine": machine(torch),
        "state_bytes": nbytes, "state_tensors": ntensors, "python_objects": args.objects,
        "rounds": args.rounds, "per_round": args.per_round,
        "default_mode": flor.materializer.DEFAULT_MODE,
        "summary": summary, "targets": verdicts, "gpu": gpu, "cold": cold,
        "samples": results,
    }
    write_report(report, args.out, render)


def render(rep):
    S = rep["state_bytes"]
    lines = [
        f"Command: `{rep['command'].strip()}`  ",
        f"Machine: {rep['machine']['cpu']}, {rep['machine']['cores']} cores, "
        f"{rep['machine']['memory_gib']} GiB, Linux {rep['machine']['kernel']}, "
        f"Python {rep['machine']['python']}, torch {rep['machine']['torch']} "
        f"({rep['machine']['threads']} thread), GPU: {rep['machine']['cuda'] or 'none'}  ",
        f"Medians of {rep['rounds']} interleaved rounds after a warm-up round; each round's "
        f"value is the median of {rep.get('per_round', 1)} checkpoints.",
        "",
    ]
    names = {"state": f"Model + Adam state, S = {S / MiB:.0f} MiB in {rep['state_tensors']} tensors",
             "python": f"dict of {rep['python_objects']:,} small lists"}
    ref = {"state": "torch.save", "python": "cloudpickle"}
    for w, per in rep["summary"].items():
        lines += [f"**{names[w]}**", "",
                  f"| method | blocks training | vs {ref[w]} | next step slowdown | durable after (range) | peak extra memory |",
                  "|---|---:|---:|---:|---:|---:|"]
        for m, s in per.items():
            mem = f"{s['extra_bytes'] / MiB:.0f} MiB"
            if w == "state":
                mem += f" ({s['extra_bytes'] / S:.2f} S)"
            lo, hi = s["durable_spread_s"]
            dur = "n/a" if s["durable_s"] != s["durable_s"] else \
                f"{s['durable_s'] * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})"
            lines.append(
                f"| {m} | {s['block_s'] * 1e3:.1f} ms | {s['block_s'] / per[ref[w]]['block_s']:.3f}x | "
                f"{s['step_slowdown'] * 100:+.0f}% | {dur} | {mem} |")
        lines.append("")
    lines += ["**Targets** (default mode: " + rep["default_mode"] + "), each the median over rounds "
              "of the ratio between two methods measured in the same round", "",
              "| target | measured | limit | met |", "|---|---:|---:|:---:|"]
    for k, v in rep["targets"].items():
        lines.append(f"| {k} | {v['measured']:.2f} {v['unit']} | {v['limit']:g} | "
                     f"{'yes' if v['met'] else 'NO'} |")
    if rep["gpu"] is None:
        lines += ["", "No GPU on this machine: the device-to-host throughput target was not measured."]
    else:
        g = rep["gpu"]
        lines += ["", f"GPU: snapshot {g['snapshot_gbps']:.1f} GB/s, pinned copy_ "
                      f"{g['pinned_copy_gbps']:.1f} GB/s ({g['fraction']:.2f} of it)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
