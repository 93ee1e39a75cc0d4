"""Running a replay's segments on worker processes of this machine (--jobs N).

Every worker (``flor _worker``, flor/runtime/entry.py run_part) runs the
edited script from the start with one segment of the plan
(flor/runtime/replaying.py).  Local workers report how many iterations of
their segment they have replayed on a pipe (at most every
replaying.REPORT_S), which drives the progress bar.
"""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

from ..errors import INTERRUPTIONS, FlorError, Interrupted, note, say
from ..store import Store
from .forkserver import PIPE, ForkServer
from .plan import Plan, register
from .progress import Progress
from .results import conclude

__all__ = ["run_local"]


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


MAX_ATTEMPTS = 3  # of one segment, before the replay fails


@contextlib.contextmanager
def _held():
    """Ctrl-C, and SIGTERM where replay handles it (`_stopped`), wait while
    a worker starts: the process it makes is tracked (and stopped if replay
    is) before either ends replay.  A signal held is raised again after."""
    ours = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _stopped}
    before = {n: signal.getsignal(n) for n in ours}
    main = threading.current_thread() is threading.main_thread()  # (handlers live there)
    held = [n for n, h in ours.items() if main and before[n] is h]
    got = []
    for n in held:
        signal.signal(n, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for n in held:
            signal.signal(n, before[n])
        for n in dict.fromkeys(got):
            signal.raise_signal(n)


class _Attempt:
    """One run of a segment by a worker process."""

    def __init__(self, store, plan, part, number, resume, slot, env, server=None):
        self.part, self.number, self.resume, self.slot = part, number, resume, slot
        self.db = store.layout.part_db(plan.replay_id, part, number)
        for stale in (self.db, self.db + "-wal", self.db + "-shm"):
            if os.path.exists(stale):
                os.unlink(stale)
        self.log = open(store.layout.worker_log(plan.replay_id, part, number), "w+")
        r, w = os.pipe()
        argv = ["_worker", store.layout.plan_path(plan.replay_id), str(part), PIPE,
                "--db", self.db] + ([] if resume else ["--no-resume"])
        self.proc = None  # a Popen, or a Forked that stands for one
        if server is not None:
            try:
                with open(os.devnull, "rb") as null:
                    self.proc = server.fork(argv, env, null.fileno(), self.log.fileno(),
                                            self.log.fileno(), w, int(env["OMP_NUM_THREADS"]))
            except OSError:
                server = None  # the server is gone: spawned instead
        if self.proc is None:
            cmd = [sys.executable, "-m", "flor", *(str(w) if a == PIPE else a for a in argv)]
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                         stdout=self.log, stderr=self.log, pass_fds=(w,))
        os.close(w)
        # Not blocking: a process the script left running in the background
        # may hold the worker's end (it is closed on exec; not on fork).
        os.set_blocking(r, False)
        self.pipe = os.fdopen(r, "rb", buffering=0)
        self.buf = b""
        self.eof = False  # the worker's end of the pipe is closed: it has exited
        self.forked = server is not None and self.proc is not None
        self.copy = False  # a copy of a slow segment's attempt
        self.started = time.monotonic()
        self.first = None  # when it reported its first iteration
        self.done = 0  # iterations it replayed

    def read(self) -> int:
        """Take what the worker reported (the iterations of its segment it
        has done, at most every replaying.REPORT_S); returns the bytes read."""
        chunk = self.pipe.read(4096)
        if not chunk:  # (None: nothing to read now)
            self.eof = self.eof or chunk == b""
            return 0
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        if lines:
            if self.first is None:
                self.first = time.monotonic()
            self.done = max(self.done, int(lines[-1]))
        return len(chunk)

    def rate(self):
        """Iterations per second since its first report, or None."""
        if self.first is None or self.done < 2:
            return None
        return (self.done - 1) / max(time.monotonic() - self.first, 1e-9)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.close()

    def close(self):
        self.pipe.close()

    def text(self) -> str:
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


class _Queue:
    """Segments handed to `slots` worker processes as they free up.  A
    worker that dies (a signal: killed, evicted) has its segment run again;
    one that fails after restoring an iteration checkpoint, again without
    it.  When nothing is left to hand out, a free worker runs a copy of the
    slowest segment if it can finish sooner; the first copy to finish wins."""

    def __init__(self, store, plan, slots, server=None):
        self.store, self.plan, self.slots = store, plan, slots
        self.todo = [(p, True) for p in range(len(plan.segments))]  # (part, resume)
        self.running: list[_Attempt] = []
        self.attempts = [0] * len(plan.segments)
        self.won: dict[int, _Attempt] = {}
        self.lost: list[_Attempt] = []
        self.failed: list[_Attempt] = []
        self.seconds_per_iter: list[float] = []
        # One worker sees every GPU, as a plain run would; several get one each, in turn.
        self.gpus = _gpus() if slots > 1 else []
        self.threads = str(plan.threads_per_worker(os.cpu_count() or 1, slots))
        self.server = server if server is not None and server.usable(int(self.threads)) else None
        self.shown = [0] * len(plan.segments)  # iterations of each segment on the progress bar
        self.restarted: dict[int, str] = {}  # part -> why it ran again from its start
        self.forked = 0  # attempts forked from the server

    def _launch(self, part, resume, copy_of=None):
        used = {a.slot for a in self.running}
        slot = min(set(range(self.slots)) - used)
        env = dict(os.environ, OMP_NUM_THREADS=self.threads, MKL_NUM_THREADS=self.threads,
                   FLOR_REPLAY_WORKER=str(slot))  # which of the --jobs workers runs it
        if copy_of is not None and copy_of.first is not None:
            # A copy of an attempt past its set-up: its set-up's writes to
            # files stay private (files.py).
            env["FLOR_REPLAY_COPY"] = "1"
        if self.plan.ranks is not None:
            # A data-parallel replay: this segment's workers of every rank make
            # one process group, whose store rank 0's worker hosts on the port
            # rank 0 chose for the segment.
            env.update(MASTER_PORT=str(self.plan.ranks["ports"][part]),
                       TORCHELASTIC_USE_AGENT_STORE="False")
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[slot % len(self.gpus)]
        with _held():
            self.running.append(_Attempt(self.store, self.plan, part, self.attempts[part],
                                         resume, slot, env, self.server))
        self.running[-1].copy = copy_of is not None
        self.forked += self.running[-1].forked
        self.attempts[part] += 1

    def _length(self, part):
        s, e = self.plan.segments[part]
        return e - s

    def _backup(self):
        """A copy of the running segment that would finish last, if a fresh
        worker is expected to finish it sooner."""
        if not self.seconds_per_iter or self.plan.ranks is not None:
            return None  # (the ranks of a data-parallel replay run each segment once)
        per_iter = sorted(self.seconds_per_iter)[len(self.seconds_per_iter) // 2]
        copies = {a.part for a in self.running if a.copy}
        # A worker's first report comes after its start-up and one iteration.
        startup = sorted(a.first - a.started for a in self.won.values() if a.first)
        startup = max(0.0, startup[len(startup) // 2] - per_iter) if startup else 0.0
        worst, worst_left = None, 0.0
        now = time.monotonic()
        for a in self.running:
            if a.part in copies:
                continue
            # Its iterations take at least this long: the one under way
            # has not ended yet.
            slowest = (now - a.started - startup) / (a.done + 1)
            rate = a.rate()
            per = max(slowest, 1 / rate if rate else 0.0)
            left = (self._length(a.part) - a.done) * per
            fresh = startup + self._length(a.part) * per_iter
            if left > 1.2 * fresh and left > worst_left:
                worst, worst_left = a, left
        return worst

    def _finished(self, a, code):
        a.close()
        self.running.remove(a)
        if a.part in self.won:  # a copy that lost the race
            self.lost.append(a)
            return True
        if code == 0:
            self.won[a.part] = a
            if a.done > 1 and a.first is not None:
                self.seconds_per_iter.append((time.monotonic() - a.first) / (a.done - 1))
            for other in [o for o in self.running if o.part == a.part]:
                other.stop()
                self.running.remove(other)
                self.lost.append(other)
            return True
        if any(o.part == a.part for o in self.running):
            self.lost.append(a)  # its copy runs on
            return True
        if self.attempts[a.part] >= MAX_ATTEMPTS or self.plan.ranks is not None:
            self.failed.append(a)
            return False
        died = code < 0
        if not died and (not a.resume or not _reached_main(self.plan, a)):
            self.failed.append(a)
            return False
        self.lost.append(a)
        how = "was killed" if died else "failed after restoring an iteration checkpoint"
        why = ""
        if not died:
            a.log.seek(0)
            lines = [l for l in a.log.read().splitlines() if l.strip()]
            why = f" ({lines[-1].strip()})" if lines else ""
            self.restarted[a.part] = lines[-1].strip() if lines else f"exit {code}"
        note(f"replay worker of segment {a.part} {how} (exit {code}){why}; running it again"
             + ("" if died else " from the start"))
        self.todo.insert(0, (a.part, a.resume if died else False))
        return True

    def _waits(self):
        """What to wait for, select's arguments: the workers' reports, and
        the fork server's word that one it forked has exited (its pipe at
        its end).  A spawned worker whose pipe ended is polled soon."""
        fds = [a.pipe for a in self.running if not a.eof]
        if any(a.forked for a in self.running) and not self.server.gone:
            fds.append(self.server.sock)  # (read by their poll())
        ending = any(a.eof and not a.forked for a in self.running)
        return fds, [], [], 0.01 if ending else 0.5

    def run(self, progress) -> bool:
        """Run every segment; False if one failed for good."""
        while self.todo or self.running:
            while self.todo and len(self.running) < self.slots:
                self._launch(*self.todo.pop(0))
            if not self.todo and len(self.running) < self.slots:
                backup = self._backup()
                if backup is not None:
                    note(f"segment {backup.part} is running slowly; running a copy of it")
                    self._launch(backup.part, True, copy_of=backup)
            ready, _, _ = select.select(*self._waits())
            for a in list(self.running):
                if a not in self.running:  # a copy stopped as its original finished
                    continue
                if a.pipe in ready:
                    a.read()
                code = a.proc.poll()
                if code is not None:
                    while a.read():
                        pass
                    if code == 0:  # (a loop that breaks ends in its body, unreported)
                        a.done = max(a.done, self._length(a.part))
                if a.done > self.shown[a.part]:  # copies count once
                    progress.step(a.done - self.shown[a.part])
                    self.shown[a.part] = a.done
                if code is not None:
                    if not self._finished(a, code):
                        for other in list(self.running):
                            other.stop()
                            self.running.remove(other)
                        return False
        return True


def _reached_main(plan, a) -> bool:
    """Whether a failed attempt got to the main loop (a failure before it,
    say of the script's argument parsing, would only happen again)."""
    try:
        rows = Store(plan.store, db_file=a.db, create=False).parts(plan.replay_id)
    except FlorError:
        return False
    return any(r["info"].main_seen for r in rows)


def _script_failure(plan, a, lines=20):
    """Say how a segment's script failed: its exit status, and the last
    lines it wrote to stderr (kept in the attempt's database)."""
    code = a.proc.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    note(f"replay failed: the script {how} in segment {a.part} "
         f"(iterations {plan.segments[a.part][0]}-{plan.segments[a.part][1] - 1})")
    try:
        rows = Store(plan.store, db_file=a.db, create=False).rows("output", plan.replay_id,
                                                                   "ORDER BY ord")
    except FlorError:
        return
    text = "".join(r["text"] for r in rows if r["stream"] == "stderr").rstrip("\n")
    if text:
        tail = text.split("\n")[-lines:]
        say(f"--- the script's stderr (last {len(tail)} lines) ---\n" + "\n".join(tail))


def _stopped(signum, frame):
    raise Interrupted()


def run_local(store: Store, plan: Plan, notes, strict=False, started=None,
              server: ForkServer | None = None) -> int:
    """Replay the plan's segments on the plan's number of local worker
    processes, then assemble; `started`: when the replay command started
    (time.time(), before planning), which its time counts from; `server`:
    the fork server to start workers from (closed here), if any."""
    for line in notes:
        note(line)
    register(store, plan, "local")
    try:
        return _run_local(store, plan, strict, started or time.time(), server)
    except INTERRUPTIONS:  # SIGTERM or Ctrl-C: its workers were stopped
        store.update_run(plan.replay_id, finished=time.time(), status="interrupted")
        raise
    finally:
        if server is not None:
            server.close()  # (reaped: _run_local let it exit)


def _run_local(store, plan, strict, t0, server) -> int:
    """run_local's work once the replay is registered (`t0`: its start)."""
    nparts = len(plan.segments)
    slots = max(1, min(plan.workers or nparts, nparts))
    progress = Progress(sum(e - s for s, e in plan.segments), slots)
    own = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if own:  # torchrun stops the other ranks of a failed one with SIGTERM
        signal.signal(signal.SIGTERM, _stopped)
    queue = None
    try:
        queue = _Queue(store, plan, slots, server)
        ok = queue.run(progress)
    finally:
        progress.close()
        if own:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for a in list(queue.running if queue else []):  # interrupted: no worker outlives replay
            a.stop()
            queue.running.remove(a)
        if server is not None:
            server.close(wait=False)  # (run_local reaps it, after the conclusion)
    for a in [*queue.won.values(), *queue.failed]:
        text = a.text()
        if text.strip():
            say(f"--- replay worker {a.part} ---\n{text.rstrip()}")
    for a in queue.lost:
        a.text()
    # What the workers' set-ups wrote privately (files.py), left by killed ones.
    shutil.rmtree(os.path.join(store.layout.run_dir(plan.replay_id), "private"),
                  ignore_errors=True)
    if not ok:
        store.update_run(plan.replay_id, finished=time.time(), status="failed")
        for a in queue.failed:
            _script_failure(plan, a)
        code = queue.failed[0].proc.returncode
        return code if code > 0 else 128 - code if code < 0 else 1  # killed: 128 + signal
    for part in range(nparts):
        store.import_part(queue.won[part].db)
    info = store.run(plan.replay_id)["info"]
    info.forked = queue.forked
    info.restarted = {str(p): why for p, why in queue.restarted.items()}  # for the checks
    store.update_run(plan.replay_id, info=info)
    for a in [*queue.won.values(), *queue.lost]:
        for path in (a.db, a.db + "-wal", a.db + "-shm"):
            if os.path.exists(path):
                os.unlink(path)
    return conclude(store, plan, time.time() - t0, strict)
