"""The state behind flor.generator, flor.SkipBlock and flor.log in one process.

Record (the default: a script that uses the API records when it runs):
    every SkipBlock body runs; at end() the adaptive rule (the C state
    machine, csrc/skipblock.c) decides whether to hand the block's side
    effects, with the random-number state, to a Materializer; logs, stdout
    and every decision are stored per iteration in the run store.

Replay (a worker started by ``python -m flor replay``):
    the main loop yields iterations [0, segment end) of the recorded count.
    Iterations before the worker's segment pseudoresume: blocks are skipped by
    loading their checkpoints (or run where there is none) and their output
    is discarded.  In the segment, probed blocks run and the others are
    skipped.  A worker that is not the last stops when its segment ends.
"""
from __future__ import annotations

import atexit
import hashlib
import io
import json
import math
import os
import random
import re
import sys
import time

from . import _core
from .checkpoint import load, restore
from .errors import CheckpointCorrupt, CheckpointWriteError
from .materializer import Materializer
from .store import Store

__all__ = ["Session", "FlorReplayError", "SegmentDone"]

DEFAULT_EPSILON = 1 / 15
DEFAULT_C = 1.38
OFF, RECORD, REPLAY = "off", "record", "replay"
BODY_RUNS = (_core.EXECUTE, _core.STEP_INTO)


class FlorReplayError(RuntimeError):
    """Replay cannot reproduce the recorded run at this point."""


class SegmentDone(BaseException):
    """Ends a replay worker whose segment of the main loop is done.

    A BaseException, like SystemExit, so that ``except Exception`` in the
    script does not catch it; the epilogue after the main loop then runs only
    in the worker that replays the last iteration."""


def _note(msg):
    print(f"flor: {msg}", file=sys.__stderr__, flush=True)


def jsonable(value):
    """Tensors and arrays become numbers (or nested lists of numbers)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.numel() == 1 else value.cpu().tolist()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return value.item() if value.size == 1 else value.tolist()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


def rng_state() -> dict:
    state = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["random"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(state["cuda"])


def signature(objs) -> list:
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in objs]


def checkpoint_name(key: str, vec, occurrence: int) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("._")[:40] or "block"
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    where = ".".join(map(str, vec)) or "top"
    return f"{slug}-{digest}@{where}" + (f"+{occurrence}" if occurrence else "")


def _ret(objs):
    if len(objs) == 0:
        return None
    return objs[0] if len(objs) == 1 else tuple(objs)


class _Loop:
    __slots__ = ("key", "depth", "index")

    def __init__(self, key, depth):
        self.key, self.depth, self.index = key, depth, -1


class _Block:
    __slots__ = ("handle", "key", "vec", "occurrence", "state", "payload", "load_s")

    def __init__(self, handle, key, vec, occurrence, state, payload, load_s):
        self.handle, self.key, self.vec, self.occurrence = handle, key, vec, occurrence
        self.state, self.payload, self.load_s = state, payload, load_s


class Output(io.TextIOBase):
    """sys.stdout while flor runs: captures each write for the session and,
    in record, passes it on to the real stdout (a tee)."""

    def __init__(self, session, real, tee):
        self._session, self._real, self._tee = session, real, tee

    def write(self, s):
        if self._tee:
            self._real.write(s)
        self._session._capture(s)
        return len(s)

    def flush(self):
        self._real.flush()

    def writable(self):
        return True

    def isatty(self):
        return self._tee and self._real.isatty()

    def fileno(self):
        return self._real.fileno()

    @property
    def encoding(self):
        return getattr(self._real, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self._real, "errors", "strict")


class Session:
    _current: "Session | None" = None

    # -- creation -----------------------------------------------------------

    @classmethod
    def get(cls) -> "Session":
        s = cls._current
        if s is not None and s.pid == os.getpid():
            return s
        if s is not None:
            # A forked child of a flor process (a DataLoader worker): inert.
            cls._current = cls(OFF)
            return cls._current
        mode = os.environ.pop("FLOR_MODE", RECORD).lower()
        if mode == OFF:
            cls._current = cls(OFF)
        elif mode == REPLAY:
            with open(os.environ.pop("FLOR_PLAN")) as f:
                plan = json.load(f)
            part = int(os.environ.pop("FLOR_PART"))
            cls._current = cls.replay(plan, part)
        elif mode == RECORD:
            main = sys.modules.get("__main__")
            cls._current = cls.record(getattr(main, "__file__", None), sys.argv)
        else:
            raise ValueError(f"FLOR_MODE must be record, replay or off, not {mode!r}")
        return cls._current

    @classmethod
    def record(cls, script, argv, epsilon=None, adaptive=None, store=None) -> "Session":
        s = cls(RECORD, store=store, script=script)
        eps = epsilon if epsilon is not None else float(
            os.environ.get("FLOR_EPSILON", DEFAULT_EPSILON))
        if adaptive is None:
            adaptive = os.environ.get("FLOR_ADAPTIVE", "1") not in ("0", "false", "off")
        c = s._estimate_c()
        s.machine = _core.SkipMachine(_core.RECORD, eps, c, adaptive)
        source = None
        if script is not None:
            with open(script) as f:
                source = f.read()
        s.run_id = s.store.new_run(RECORD, s.script, argv, source, epsilon=eps, c=c,
                                   versions=json.dumps(_versions()),
                                   info=json.dumps({"adaptive": adaptive}))
        s._start_output(tee=True)
        cls._current = s
        return s

    @classmethod
    def replay(cls, plan, part) -> "Session":
        s = cls(REPLAY, store=Store(plan["store"]), script=plan["script"])
        s.plan, s.part = plan, part
        s.run_id = plan["replay_id"]
        s.segment = tuple(plan["segments"][part])
        s.last_part = part == len(plan["segments"]) - 1
        s.probed = set(plan["probed"])
        s.lines = {int(k): v for k, v in plan["lines"].items()}
        s.ckpts = {(b, it, int(o)): f for b, it, o, f in plan["checkpoints"]}
        s.ckpt_dir = plan["ckpt_dir"]
        s.machine = _core.SkipMachine(_core.REPLAY, plan["epsilon"], plan["c"])
        s.phase = "pre"
        s.progress_fd = plan.get("progress_fd")
        s._start_output(tee=plan.get("tee", False))
        s.store.set_part(s.run_id, part, "running")
        cls._current = s
        return s

    def __init__(self, mode, store=None, script=None):
        self.mode = mode
        self.pid = os.getpid()
        self.store = store or (Store() if mode != OFF else None)
        self.script = os.path.abspath(script) if script else None
        self.script_name = os.path.basename(script) if script else None
        self.run_id = None
        self.part = 0
        self.machine = None
        self.lines = None  # replay: current line -> recorded line of the script
        self.loops: list[_Loop] = []
        self.blocks: list[_Block] = []
        self.names: dict[str, str] = {}  # block name -> its call site
        self.occurrences: dict[str, tuple] = {}
        self.seqs: dict[tuple, int] = {}
        self.pending_logs, self.pending_out, self.decisions = [], [], []
        self.loop_stats = []
        self.ord = 0
        self.discard = False
        self.phase = None
        self.last_bytes: dict[str, int] = {}
        self.reexecuted = 0
        self.started = time.time()
        self.finished = False
        self._mat = None
        self._bw = None
        self._stdout = None
        if mode != OFF:
            atexit.register(self.finish)

    def _start_output(self, tee):
        self._stdout = sys.stdout
        sys.stdout = Output(self, sys.stdout, tee)

    # -- identity -----------------------------------------------------------

    def site(self, frame) -> str:
        """file:line of a call, in the recorded source's line numbers."""
        fn = os.path.abspath(frame.f_code.co_filename)
        line = frame.f_lineno
        if fn == self.script:
            if self.lines is not None:
                old = self.lines.get(line)
                return f"{self.script_name}:{old}" if old else f"{self.script_name}:new:{line}"
            return f"{self.script_name}:{line}"
        return f"{os.path.relpath(fn)}:{line}"

    def _vec(self):
        return tuple(lp.index for lp in self.loops)

    # -- loops --------------------------------------------------------------

    def loop(self, iterable, name, frame):
        if self.mode == OFF:
            return iter(iterable)
        key = name or self.site(frame)
        depth = len(self.loops)
        if self.mode == REPLAY and depth == 0 and key == self.plan["main_loop"]:
            return self._replay_main(iterable, key)
        return self._loop(iterable, key, depth)

    def _loop(self, iterable, key, depth):
        lp = _Loop(key, depth)
        self.loops.append(lp)
        t0, n = time.perf_counter(), 0
        try:
            for x in iterable:
                lp.index = n
                n += 1
                yield x
                if depth == 0:
                    self._flush()
        finally:
            self.loops.remove(lp)
            self.loop_stats.append((key, depth, n, time.perf_counter() - t0))

    def _replay_main(self, iterable, key):
        total = self.plan["iterations"]
        start, end = self.segment
        lp = _Loop(key, 0)
        self.loops.append(lp)
        self.phase = "main"
        t0, n = time.perf_counter(), 0
        try:
            for x in iterable:
                if n >= min(end, total):
                    break
                pseudo = n < start
                self.machine.phase = _core.PSEUDORESUME_PHASE if pseudo else _core.WORK
                self.discard = pseudo
                lp.index = n
                n += 1
                yield x
                if not pseudo:
                    self._flush()
                    self._progress(lp.index)
        finally:
            self.discard = False
            self.machine.phase = _core.WORK
            self.loops.remove(lp)
            self.loop_stats.append((key, 0, n, time.perf_counter() - t0))
            self.phase = "post"
        if not self.last_part:
            raise SegmentDone(self.part)

    def _progress(self, index):
        if self.progress_fd is not None:
            try:
                os.write(self.progress_fd, f"{self.part} {index}\n".encode())
            except OSError:
                self.progress_fd = None

    # -- blocks -------------------------------------------------------------

    def step_into(self, name, probed, frame) -> bool:
        if self.mode == OFF:
            return True
        where = self.site(frame)
        if name is not None:
            first = self.names.setdefault(name, where)
            if first != where:
                raise ValueError(
                    f"SkipBlock name {name!r} is used at {first} and at {where}; "
                    "give each block its own name")
        key = name or where
        handle = self.machine.block(key)
        vec = self._vec()
        last = self.occurrences.get(key)
        occurrence = last[1] + 1 if last is not None and last[0] == vec else 0
        self.occurrences[key] = (vec, occurrence)
        payload, load_s = None, 0.0
        if self.mode == REPLAY:
            probed = probed or key in self.probed
            if self.machine.phase == _core.PSEUDORESUME_PHASE or not probed:
                t0 = time.perf_counter()
                payload = self._load(key, vec, occurrence)
                load_s = time.perf_counter() - t0
        state = self.machine.enter(handle, bool(probed), payload is not None)
        self.blocks.append(_Block(handle, key, vec, occurrence, state, payload, load_s))
        return state in BODY_RUNS

    def _load(self, key, vec, occurrence):
        fname = self.ckpts.get((key, json.dumps(list(vec)), occurrence))
        if fname is None:
            self.reexecuted += 1  # record did not checkpoint this execution
            return None
        path = os.path.join(self.ckpt_dir, fname)
        try:
            payload = load(path, map_location="cpu")
        except FileNotFoundError:
            _note(f"checkpoint {fname} is missing; re-executing block {key!r} "
                  f"at iteration {list(vec)}")
        except CheckpointCorrupt as e:
            _note(f"{e}; re-executing block {key!r} at iteration {list(vec)}")
        else:
            if isinstance(payload, dict) and payload.get("block") == key:
                return payload
            _note(f"checkpoint {fname} does not belong to block {key!r}; "
                  f"re-executing it at iteration {list(vec)}")
        self.reexecuted += 1
        return None

    def end(self, objs, frame):
        if self.mode == OFF:
            return _ret(objs)
        if not self.blocks:
            raise RuntimeError(
                "flor.SkipBlock.end() without a matching flor.SkipBlock.step_into()")
        b = self.blocks.pop()
        state, seconds = self.machine.leave(b.handle)
        if state == _core.EXECUTE:
            self._decide(b, objs, seconds)
            return _ret(objs)
        if state == _core.STEP_INTO:
            return _ret(objs)
        t0 = time.perf_counter()
        saved = b.payload
        if saved["sig"] != signature(objs):
            raise FlorReplayError(
                f"SkipBlock {b.key!r} at iteration {list(b.vec)}: its checkpoint holds "
                f"{saved['sig']} but end() received {signature(objs)}. The program changed "
                "after record, so flor cannot skip this block; pass probed=True to its "
                "step_into() to re-execute it")
        out = [restore(live, s) for live, s in zip(objs, saved["objs"])]
        set_rng_state(saved["rng"])
        torch = sys.modules.get("torch")
        for o in out:
            if torch is not None and isinstance(o, torch.optim.Optimizer):
                # The block stepped this optimizer in record; torch's LR
                # schedulers read this flag to warn about a missing step().
                o._opt_called = True
        self.machine.restored(b.handle, b.load_s + time.perf_counter() - t0)
        return _ret(out)

    def _decide(self, b, objs, seconds):
        nbytes = self.last_bytes.get(b.key)
        if nbytes is None:
            nbytes = _core.measure(list(objs))
        bw = self.bandwidth()
        ok, reason, ratio, limit, M = self.machine.decide(b.handle, nbytes, bw)
        fname = None
        if ok:
            fname = checkpoint_name(b.key, b.vec, b.occurrence)
            payload = {"block": b.key, "iter": list(b.vec), "occurrence": b.occurrence,
                       "sig": signature(objs), "objs": list(objs), "rng": rng_state()}
            try:
                self.last_bytes[b.key] = self._materializer().submit(fname, payload)
            except CheckpointWriteError as e:
                _note(f"checkpoint of block {b.key!r} failed: {e}")
                fname = None
        st = self.machine.stats()[b.handle]
        vec = list(b.vec)
        self.decisions.append((
            self.run_id, b.key, json.dumps(vec), b.occurrence, vec[0] if vec else None,
            st["n"], st["k"], seconds, st["compute_s"] / st["n"], nbytes, bw, M,
            ratio if math.isfinite(ratio) else None, limit, int(ok), reason,
            fname + ".flor" if fname else None))

    def _materializer(self):
        if self._mat is None:
            self._mat = Materializer(self.store.ckpt_dir(self.run_id))
        return self._mat

    def bandwidth(self) -> float:
        """Bytes per second this machine materializes: measured by the run's
        own writes once there are some, else by a one-time calibration."""
        if self._mat is not None:
            st = self._mat.stats()
            if st["written"] >= 2 and st["write_seconds"] > 0:
                return st["bytes_written"] / st["write_seconds"]
        if self._bw is None:
            self._bw = self.store.bandwidth(self._calibrate)
        return self._bw

    def _calibrate(self) -> float:
        from .checkpoint import save

        n = 32 << 20
        path = os.path.join(self.store.root, f"calibrate.{os.getpid()}.flor")
        t0 = time.perf_counter()
        save({"bytes": bytearray(n)}, path)
        dt = time.perf_counter() - t0
        os.unlink(path)
        return n / dt

    def _estimate_c(self) -> float:
        """Restore time over materialize time, from earlier replays of this
        script: the median over blocks of (seconds per restore) / (estimated
        seconds per checkpoint).  1.38 (the paper's measurement) until then."""
        if self.script_name is None:
            return DEFAULT_C
        rows = self.store.db.execute(
            "SELECT b.restore_s / b.restores AS r, m.materialize_s / m.k AS w "
            "FROM blocks b JOIN runs rp ON b.run_id = rp.run_id "
            "JOIN runs rc ON rp.parent = rc.run_id "
            "JOIN blocks m ON m.run_id = rc.run_id AND m.block = b.block "
            "WHERE rc.script_name = ? AND b.restores > 0 AND m.k > 0 AND m.materialize_s > 0",
            (self.script_name,)).fetchall()
        ratios = sorted(r["r"] / r["w"] for r in rows if r["w"] > 0)
        if not ratios:
            return DEFAULT_C
        return ratios[len(ratios) // 2]

    # -- logs and output ----------------------------------------------------

    def log(self, name, value, frame):
        if self.mode == OFF or self.discard:
            return
        loc = self.site(frame)
        vec = self._vec()
        k = (name, loc, vec)
        seq = self.seqs.get(k, 0)
        self.seqs[k] = seq + 1
        self.ord += 1
        outer = self.loops[0].key if self.loops else None
        self.pending_logs.append((self.run_id, self.part, self.ord, self.phase, outer, name,
                                  json.dumps(list(vec)), seq, json.dumps(jsonable(value)), loc))

    def _capture(self, text):
        if self.discard or not text:
            return
        outer = self.loops[0] if self.loops else None
        loop, it = (outer.key, outer.index) if outer else (None, None)
        last = self.pending_out[-1] if self.pending_out else None
        if last is not None and last[3] == self.phase and last[4] == loop and last[5] == it:
            last[6] += text
            return
        self.ord += 1
        self.pending_out.append([self.run_id, self.part, self.ord, self.phase, loop, it, text])

    def _flush(self):
        if self.mode == OFF:
            return
        logs, out, dec = self.pending_logs, self.pending_out, self.decisions
        self.pending_logs, self.pending_out, self.decisions = [], [], []
        self.seqs.clear()
        self.store.add_logs(logs)
        self.store.add_output([tuple(r) for r in out])
        self.store.add_decisions(dec)

    # -- the end ------------------------------------------------------------

    def finish(self, error: BaseException | None = None):
        """Make every checkpoint durable and store what the run measured."""
        if self.finished or self.mode == OFF or self.pid != os.getpid():
            return
        self.finished = True
        if isinstance(sys.stdout, Output) and sys.stdout._session is self:
            sys.stdout.flush()
            sys.stdout = self._stdout
        failures = []
        if self._mat is not None:
            try:
                self._mat.close()
            except CheckpointWriteError as e:
                failures = e.failures
                _note(str(e))
        self._flush()
        stats = self.machine.stats()
        self.store.add_blocks([
            (self.run_id, self.part, s["key"], s["n"], s["k"], s["compute_s"],
             s["materialize_s"], s["restore_s"], s["restores"], s["skips"], s["steps"],
             s["nbytes"]) for s in stats])
        self.store.add_loops([(self.run_id, self.part, *row) for row in self.loop_stats])
        status = "failed" if error is not None and not isinstance(error, SegmentDone) else "finished"
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else None
        if self.mode == RECORD:
            top = [row for row in self.loop_stats if row[1] == 0]
            main = max(top, key=lambda r: r[3]) if top else None
            self.store.update_run(
                self.run_id, finished=time.time(), status=status,
                main_loop=main[0] if main else None, iterations=main[2] if main else 0,
                versions=json.dumps(_versions()),
                info=json.dumps({"failed_writes": [f[0] for f in failures], "threads": threads,
                                 "adaptive": self.machine.adaptive,
                                 "error": repr(error) if error else None}))
        else:
            self.store.set_part(self.run_id, self.part, status, time.time() - self.started,
                                {"reexecuted": self.reexecuted, "threads": threads,
                                 "error": repr(error) if status == "failed" else None})


def _versions():
    v = {"python": sys.version.split()[0], "flor": _flor_version()}
    for mod in ("torch", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    return v


def _flor_version():
    from . import __version__

    return __version__
