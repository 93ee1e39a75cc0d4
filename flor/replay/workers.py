"""Running a replay's segments: worker processes on this machine (--jobs N),
or one segment in this process (--part I/N, for schedulers that run the
parts elsewhere; each part writes a database of its own, which merge
imports).

Every worker runs the edited script from the start with one segment of the
plan (flor/runtime/replaying.py).  Local workers report each replayed
iteration on a pipe, which drives the progress bar.
"""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time

from ..errors import note
from ..runtime.script import run_main
from ..runtime.session import Session
from ..store import Store
from .plan import Plan, instrument_current, register
from .results import conclude

__all__ = ["run_local", "run_part"]


def run_part(plan: Plan, part: int, tee=False, own_db=False, progress_fd=None) -> int:
    """Run segment `part` of the plan in this process (a worker, or --part):
    `tee` also shows the script's stdout, `own_db` stores into the part's
    own database, `progress_fd` reports each replayed iteration."""
    store = Store(plan.store)
    if own_db:
        store = Store(plan.store, db_file=store.part_db(plan.replay_id, part))
        if plan.threads and "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(plan.threads)  # before the script imports torch
    session = Session.replay(plan, part, store=store, tee=tee, progress_fd=progress_fd)
    script = plan.script
    sys.argv = list(plan.argv)
    sys.path[0] = os.path.dirname(script)
    inst = None
    if plan.hands_free:
        with open(script) as f:
            inst = instrument_current(f.read(), script,
                                      plan.line_maps().get(os.path.basename(script), ({},))[0])
    error, code = None, 0
    try:
        code, error = run_main(script, sys.__stderr__, inst)
    finally:
        session.finish(error)
    return code


class _Progress:
    def __init__(self, total, parts):
        self.total, self.parts, self.done = total, parts, 0
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def step(self, n=1):
        self.done += n
        self.show()

    def show(self, final=False):
        pct = int(100 * self.done / self.total) if self.total else 100
        if self.tty:
            width = 30
            fill = int(width * self.done / self.total) if self.total else width
            sys.stderr.write(f"\rreplay [{'#' * fill}{'.' * (width - fill)}] "
                             f"{self.done}/{self.total} iterations, {self.parts} workers")
            if final:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif final or pct // 25 > self.shown:
            self.shown = pct // 25
            print(f"replay: {self.done}/{self.total} iterations", file=sys.stderr, flush=True)


def _gpus():
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(l for l in out.splitlines() if l.startswith("GPU"))]


def run_local(store: Store, plan: Plan, rec, notes, source, strict=False) -> int:
    """Replay every segment in a worker process of its own, then assemble."""
    nparts = len(plan.segments)
    t0 = time.time()
    for line in notes:
        note(line)
    register(store, plan, rec, source, "local")
    r, w = os.pipe()
    threads = str(plan.threads or max(1, (os.cpu_count() or 1) // nparts))
    gpus = _gpus()
    procs, logs = [], []
    for p in range(nparts):
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[p % len(gpus)]
        err = open(store.worker_log(plan.replay_id, p), "w+")
        logs.append(err)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flor", "_worker", store.plan_path(plan.replay_id), str(p),
             str(w)],
            env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err, pass_fds=(w,)))
    os.close(w)
    progress = _Progress(sum(e - s for s, e in plan.segments), nparts)
    progress.show()
    buf = b""
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], 1.0)
            if ready:
                chunk = pipe.read(4096)
                if not chunk:
                    break  # every worker has exited
                buf += chunk
                *lines, buf = buf.split(b"\n")
                progress.step(len(lines))
    codes = [proc.wait() for proc in procs]
    progress.show(final=True)
    failed = [p for p, c in enumerate(codes) if c != 0]
    for p, err in enumerate(logs):
        err.seek(0)
        text = err.read()
        err.close()
        if text.strip():
            print(f"--- replay worker {p} ---\n{text.rstrip()}", file=sys.stderr)
    if failed:
        store.update_run(plan.replay_id, finished=time.time(), status="failed")
        note(f"replay failed in worker{'s' if len(failed) > 1 else ''} "
             f"{', '.join(map(str, failed))}")
        return 1
    return conclude(store, plan, rec, time.time() - t0, strict)
