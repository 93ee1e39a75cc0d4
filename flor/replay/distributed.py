"""Replay on more than one machine.

``--backend ray``: each segment of the plan is a Ray task that runs a
replay worker process (``python -m flor _worker``) and stores into a
database of its own in the run store, which must be on a filesystem every
node sees.  A task asks for one GPU where the cluster has GPUs, else for one
worker's share of CPU cores.  Ray retries a task whose node or worker dies
(an evicted machine), and this module re-raises a worker process killed by a
signal as an error Ray retries too.  The driver imports each segment's
database and assembles the replay as the local queue does.  Ray is an
optional extra: ``pip install 'flor-hindsight[ray]'``.

``--part I/N`` and ``--parts N`` (flor/__main__.py) are for schedulers that
run arrays of jobs (SLURM, Kubernetes indexed jobs); ``merge`` assembles.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

from ..errors import FlorError, note, say
from .plan import Plan, register
from .results import conclude

__all__ = ["run_ray", "array_index", "import_ray"]

RETRIES = 3


class WorkerKilled(RuntimeError):
    """A segment's worker process was killed by a signal: Ray runs the task again."""


def _segment(plan_path: str, part: int, db_dir: str, threads: int) -> dict:
    """A Ray task: replay segment `part` in a worker process of its own."""
    db = os.path.join(db_dir, f"part-{part}.{secrets.token_hex(4)}.db")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", "flor", "_worker", plan_path, str(part),
                           "--db", db], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    if proc.returncode < 0:
        raise WorkerKilled(f"the worker of segment {part} was killed by signal "
                           f"{-proc.returncode}")
    return {"part": part, "code": proc.returncode, "db": db,
            "stderr": proc.stdout + proc.stderr}


def import_ray():
    """The ray module, or a FlorError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise FlorError("--backend ray needs Ray, an optional extra: "
                        "pip install 'flor-hindsight[ray]' (or pip install ray); without it, "
                        "replay runs its workers on this machine (--jobs N)") from None
    return ray


def run_ray(store, plan: Plan, notes, strict=False, started=None) -> int:
    """Replay every segment as a Ray task, then assemble; `started`: when
    the replay command started (before planning)."""
    ray = import_ray()
    for line in notes:
        note(line)
    t0 = started or time.time()
    register(store, plan, "ray")
    started_here = not ray.is_initialized()
    if started_here:
        # RAY_ADDRESS names a running cluster; without it Ray starts one here.
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False,
                 include_dashboard=False)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        cpus = ray.cluster_resources().get("CPU", 1)
        threads = plan.threads_per_worker(int(cpus), len(plan.segments))
        task = ray.remote(_segment).options(
            max_retries=RETRIES, retry_exceptions=[WorkerKilled],
            num_gpus=1 if gpus else 0, num_cpus=0 if gpus else threads)
        db_dir = store.layout.run_dir(plan.replay_id)
        refs = [task.remote(store.layout.plan_path(plan.replay_id), p, db_dir, threads)
                for p in range(len(plan.segments))]
        try:
            results = ray.get(refs)
        except ray.exceptions.RayError as e:
            store.update_run(plan.replay_id, finished=time.time(), status="failed")
            raise FlorError(f"replay {plan.replay_id} failed on Ray: {e}") from None
    finally:
        if started_here:
            ray.shutdown()
    failed = [r for r in results if r["code"] != 0]
    for r in results:
        if r["stderr"].strip():
            say(f"--- replay worker {r['part']} ---\n{r['stderr'].rstrip()}")
    if failed:
        store.update_run(plan.replay_id, finished=time.time(), status="failed")
        note(f"replay failed in segments {', '.join(str(r['part']) for r in failed)}")
        return 1
    for r in results:
        store.import_part(r["db"])
        for path in (r["db"], r["db"] + "-wal", r["db"] + "-shm"):
            if os.path.exists(path):
                os.unlink(path)
    return conclude(store, plan, time.time() - t0, strict)


def array_index(env=None) -> int:
    """This job's index in a scheduler's array, from 0: SLURM's
    SLURM_ARRAY_TASK_ID less SLURM_ARRAY_TASK_MIN (so ``--array=1-4`` and
    ``--array=0-3`` both work), or a Kubernetes indexed job's
    JOB_COMPLETION_INDEX."""
    env = os.environ if env is None else env
    if "SLURM_ARRAY_TASK_ID" in env:
        try:
            return int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        except ValueError:
            raise FlorError("SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_MIN must be whole "
                            "numbers") from None
    if "JOB_COMPLETION_INDEX" in env:
        try:
            return int(env["JOB_COMPLETION_INDEX"])
        except ValueError:
            raise FlorError("JOB_COMPLETION_INDEX must be a whole number") from None
    raise FlorError("--parts N takes this job's index from the scheduler's array, and none "
                    "is set (SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX); use --part I/N")
