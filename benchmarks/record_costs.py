"""Where a record's overhead goes: `python -m flor record` run in this
process, with wall-clock timers around flor's own functions (no profiler,
whose own cost would swamp small calls).

    python benchmarks/record_costs.py [--json FILE] [flor record options] SCRIPT ARGS...

At exit it prints, for each timed function, its calls and total seconds
(nested ones overlap: `_checkpoint` holds `submit`, which holds the GPU
`copy`), then the staging pool's counters and each materializer's as it
closed.  Run it beside a plain run of the same script (interleaved, as
gpu_lease.sh does) to put the timers against the whole overhead.  Timers are taken only on
functions looked up at call time (module attributes, methods), so what
they time is what the record runs; the instrumented script's own calls
into flor (handsfree.end, step_into) read their caller's frame and are
left as they are.
"""
import atexit
import functools
import importlib
import json
import runpy
import sys
import time

TIMED = [
    ("flor.runtime.entry", None, "instrument"),  # hands-free analysis, at start
    ("flor._core", None, "fingerprint"),  # state fingerprints (and digests' tensor bytes)
    ("flor._cuda", None, "digest"),  # the device part of a fingerprint: one synchronisation
    ("flor._cuda", None, "later"),  # the same, queued (a block-end fingerprint)
    ("flor._cuda", None, "copy"),  # queueing a checkpoint's device-to-host copy
    ("flor.materializer", "Materializer", "submit"),  # a checkpoint's time on the training thread
    ("flor.materializer", "Materializer", "close"),  # the wait for the writer at exit
    ("flor.runtime.writes", None, "calibration"),  # once per store
    ("flor.runtime.charge", "StateReads", "size"),  # measuring a state's bytes for the rule
    ("flor.runtime.recording", "Recording", "_checkpoint"),  # the rule and the submit
    ("flor.runtime.recording", "Recording", "iteration_done"),
    ("flor.runtime.logbook", "Logbook", "iteration_state"),
    ("flor.runtime.logbook", "Logbook", "state"),
    ("flor.runtime.logbook", "Logbook", "settle"),  # reading the queued ones, before a flush
    ("flor.runtime.logbook", "Logbook", "flush"),
    ("flor.runtime.handsfree", None, "_capture"),
]

totals: dict = {}
writers: list = []  # each materializer's counters as it closes


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            got = totals.setdefault(name, [0, 0.0])
            got[0] += 1
            got[1] += time.perf_counter() - t0
    return wrapper


def install():
    from flor.materializer import Materializer

    close = Materializer.close

    def closing(self, *args, **kwargs):
        writers.append(self.stats())
        return close(self, *args, **kwargs)

    Materializer.close = functools.update_wrapper(closing, close)
    for module, cls, attr in TIMED:
        owner = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        name = f"{module.rsplit('.', 1)[-1]}.{cls + '.' if cls else ''}{attr}"
        setattr(owner, attr, timed(name, getattr(owner, attr)))


def report(out):
    from flor import _core

    rows = {k: {"calls": n, "seconds": round(s, 4)} for k, (n, s) in
            sorted(totals.items(), key=lambda kv: -kv[1][1])}
    got = {"timers": rows, "pool": _core.pool_stats(), "writers": writers}
    for k, v in rows.items():
        print(f"  {k:40s} {v['calls']:6d} calls {v['seconds']:8.3f} s", file=sys.stderr)
    print(f"  pool {got['pool']}", file=sys.stderr)
    for w in writers:
        print("  writer " + ", ".join(f"{k} {w[k]:.4g}" for k in (
            "submitted", "bytes_written", "write_seconds", "block_seconds", "max_block_seconds",
            "peak_held_bytes", "pending", "writer_cpu_seconds")), file=sys.stderr)
    if out:
        with open(out, "w") as f:
            json.dump(got, f, indent=1)


def main():
    argv = sys.argv[1:]
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    install()
    atexit.register(report, out)  # registered first: runs after flor's own exit work
    sys.argv = ["flor", "record", *argv]
    runpy.run_module("flor", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
