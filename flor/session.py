"""The state behind flor.generator, flor.SkipBlock and flor.log in one process.

Record (the default: a script that uses the API records when it runs):
    every SkipBlock body runs; at end() the adaptive rule (the C state
    machine, csrc/skipblock.c) decides whether to hand the block's side
    effects, with the random-number state, to a Materializer; logs, stdout
    and every decision are stored in the run store.

Replay (a worker started by ``python -m flor replay``):
    the main loop yields iterations [0, segment end) of the recorded count.
    Iterations before the worker's segment pseudoresume: blocks are skipped by
    loading their checkpoints (or run where there is none) and their output
    is discarded.  In the segment, probed blocks run and the others are
    skipped.  A worker that is not the last stops when its segment ends.

Identity.  Everything flor stores is keyed by its *context*: the enclosing
flor.generator loops, each as (loop, k, index) where k counts the runs of
that loop in its own context, and the enclosing SkipBlock executions, each
as (block, occurrence) where occurrence counts that block's executions in
its context.  A checkpoint, a logged value or a decision belongs to exactly
one execution, even when a function holding a loop runs twice or a block
runs several times per epoch; a block skipped in replay leaves the numbering
of what follows it unchanged.
"""
from __future__ import annotations

import atexit
import functools
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
_FLOR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
BODY_RUNS = (_core.EXECUTE, _core.STEP_INTO)
STATE_NAMES = {_core.EXECUTE: "execute", _core.SKIP: "skip", _core.STEP_INTO: "step_into",
               _core.PSEUDORESUME: "pseudoresume"}


class FlorReplayError(RuntimeError):
    """Replay cannot reproduce the recorded run at this point."""


class SegmentDone(BaseException):
    """Ends a replay worker whose segment of the main loop is done.

    A BaseException, like SystemExit, so that ``except Exception`` in the
    script does not catch it; the code after the main loop then runs only in
    the worker that replays the last iteration."""


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


def module_modes(objs):
    """The training flag of every submodule of every nn.Module in objs, which
    state_dict() leaves out but code after the block may depend on."""
    torch = sys.modules.get("torch")
    if torch is None:
        return [None] * len(objs)
    return [{name: m.training for name, m in o.named_modules()}
            if isinstance(o, torch.nn.Module) else None for o in objs]


def set_module_modes(objs, modes):
    for o, mode in zip(objs, modes or []):
        if mode:
            for name, m in o.named_modules():
                if name in mode:
                    m.training = mode[name]


def signature(objs) -> list:
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in objs]


def _dumps(ctx):
    return json.dumps(ctx, separators=(",", ":"))


def checkpoint_name(key: str, ctx: str, occurrence: int, indices) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("._")[:40] or "block"
    where = ".".join(map(str, indices)) or "top"
    digest = hashlib.sha1(f"{key}\0{ctx}\0{occurrence}".encode()).hexdigest()[:10]
    return f"{slug}@{where}-{digest}"


def _accounted(method):
    """Add the time spent in `method` to the session's own main-thread time
    (once: calls nested in another accounted call are not counted twice)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        if self._in_flor:
            return method(self, *args, **kwargs)
        self._in_flor = True
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.flor_s += time.perf_counter() - t0
            self._in_flor = False
    return timed


def _rebind(live, saved):
    """A rebound name's restored value: the saved one, except that an object
    restored through its state dict is loaded into the live object."""
    if callable(getattr(live, "load_state_dict", None)) and isinstance(saved, dict) \
            and not isinstance(live, dict):
        return restore(live, saved)
    return saved


def _ret(objs):
    if len(objs) == 0:
        return None
    return objs[0] if len(objs) == 1 else tuple(objs)


class _Block:
    __slots__ = ("handle", "key", "ctx", "occurrence", "state", "payload", "load_s")

    def __init__(self, handle, key, ctx, occurrence, state, payload, load_s):
        self.handle, self.key, self.ctx, self.occurrence = handle, key, ctx, occurrence
        self.state, self.payload, self.load_s = state, payload, load_s


class _Binary:
    """sys.stdout.buffer of an Output: bytes are captured like text."""

    def __init__(self, owner):
        self._owner = owner

    def write(self, b):
        self._owner.write(bytes(b).decode(self._owner.encoding, "replace"))
        return len(b)

    def flush(self):
        self._owner.flush()

    def __getattr__(self, name):
        return getattr(self._owner._real.buffer, name)


class Output(io.TextIOBase):
    """sys.stdout (and, in a replay worker, sys.stderr) while flor runs:
    each write is captured for the session and, when `tee` is set, passed on
    to the real stream.  Anything else is delegated to the real stream."""

    def __init__(self, session, real, stream, tee):
        self._session, self._real, self._stream, self._tee = session, real, stream, tee

    def write(self, s):
        if self._tee:
            self._real.write(s)
        self._session._capture(self._stream, s)
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
    def buffer(self):
        return _Binary(self)

    @property
    def encoding(self):
        return getattr(self._real, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self._real, "errors", "strict")

    def __getattr__(self, name):
        return getattr(self._real, name)


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
        elif mode == RECORD:
            main = sys.modules.get("__main__")
            cls._current = cls.record(getattr(main, "__file__", None), sys.argv,
                                      watch_exceptions=True)
        else:
            raise ValueError(f"FLOR_MODE must be record or off, not {mode!r}; replay runs "
                             "through `python -m flor replay`")
        return cls._current

    @classmethod
    def record(cls, script, argv, epsilon=None, adaptive=None, store=None,
               watch_exceptions=False, hands_free=None) -> "Session":
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
                                   info=json.dumps({"adaptive": adaptive,
                                                    "hands_free": hands_free is not None}))
        s.hands_free = hands_free is not None
        if hands_free is not None:
            run_dir = s.store.run_dir(s.run_id)
            with open(os.path.join(run_dir, "instrumented.py"), "w") as f:
                f.write(hands_free.text + "\n")
            with open(os.path.join(run_dir, "handsfree.json"), "w") as f:
                json.dump(hands_free.summary(), f, indent=1)
        s._capture_streams(stdout_tee=True, stderr=False)
        if watch_exceptions:
            s._watch_exceptions()
        cls._current = s
        return s

    @classmethod
    def replay(cls, plan, part, store=None) -> "Session":
        s = cls(REPLAY, store=store or Store(plan["store"]), script=plan["script"])
        s.plan, s.part = plan, part
        s.run_id = plan["replay_id"]
        s.segment = tuple(plan["segments"][part])
        s.last_part = part == len(plan["segments"]) - 1
        s.probed = set(plan["probed"])
        s.no_restore = set(plan["changed_end"])
        s.files = {rel: {"lines": {int(k): v for k, v in f["lines"].items()},
                         "sites": {int(k): v for k, v in f["sites"].items()}}
                   for rel, f in plan["files"].items()}
        s.ckpts = {(b, c, int(o)): f for b, c, o, f in plan["checkpoints"]}
        s.ckpt_dir = plan["ckpt_dir"]
        s.main = (plan["main_loop"], plan["main_run"])
        s.machine = _core.SkipMachine(_core.REPLAY, plan["epsilon"], plan["c"])
        s.phase = "pre"
        s.progress_fd = plan.get("progress_fd")
        s._capture_streams(stdout_tee=plan.get("tee", False), stderr=True)
        s.store.clear_part(s.run_id, part)
        s.store.set_part(s.run_id, part, "running")
        cls._current = s
        return s

    def __init__(self, mode, store=None, script=None):
        self.mode = mode
        self.pid = os.getpid()
        self.store = store or (Store() if mode != OFF else None)
        self.script = os.path.abspath(script) if script else None
        self.base = os.path.dirname(self.script) if self.script else os.getcwd()
        self.script_name = os.path.basename(script) if script else None
        self.run_id = None
        self.part = 0
        self.machine = None
        self.files = None  # replay: {relpath: line and site maps}
        self.main = None  # replay: (main loop key, its run number)
        self.main_seen = False
        self.ctx: list[list] = []  # the current context, outermost first
        self.counts: dict[tuple, int] = {}
        self.blocks: list[_Block] = []
        self.names: dict[str, str] = {}  # block name -> its call site
        self.seen_files: set[str] = set()
        self.pending_logs, self.pending_out, self.decisions, self.blockruns = [], [], [], []
        self.loop_stats = []
        self.ord = 0
        self.discard = False
        self.phase = None
        self.last_bytes: dict[str, int] = {}
        self.reexecuted = 0
        self.started = time.time()
        self.flor_s = 0.0  # seconds flor itself spent on the main thread
        self._in_flor = False
        self.finished = False
        self.error = None
        self._mat = None
        self._bw = None
        self._streams = {}
        self._hook = None
        self.hands_free = False
        self._sig_noted: set[str] = set()
        self.block_labels: dict[str, list] = {}  # hands-free: what each block captured
        self._line = None  # a printed line not yet ended: [where, phase, top, indices, text]
        self._user_files: dict[str, bool] = {}
        if mode != OFF:
            atexit.register(self.finish)

    def _capture_streams(self, stdout_tee, stderr):
        self._streams["stdout"] = sys.stdout
        sys.stdout = Output(self, sys.stdout, "stdout", stdout_tee)
        if stderr:
            self._streams["stderr"] = sys.stderr
            sys.stderr = Output(self, sys.stderr, "stderr", False)

    def _watch_exceptions(self):
        """Note an uncaught exception (the run then ends as failed); the hook
        that was installed keeps running and is put back at the end."""
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            self.error = exc
            previous(exc_type, exc, tb)

        self._hook = (hook, previous)
        sys.excepthook = hook

    # -- identity -----------------------------------------------------------

    def site(self, frame, structural=False) -> str:
        """relpath:line of a call, in the recorded file's line numbers.
        Paths are relative to the script's directory."""
        fn = os.path.abspath(frame.f_code.co_filename)
        rel = os.path.relpath(fn, self.base)
        line = frame.f_lineno
        if self.mode == RECORD and fn not in self.seen_files:
            self.seen_files.add(fn)
            if fn != self.script and not rel.startswith("..") and os.path.isfile(fn):
                with open(fn) as f:
                    self.store.save_module_source(self.run_id, rel, f.read())
        if self.files is not None and rel in self.files:
            fmap = self.files[rel]
            old = fmap["sites"].get(line) if structural else None
            old = old if old is not None else fmap["lines"].get(line)
            return f"{rel}:{old}" if old is not None else f"{rel}:new:{line}"
        return f"{rel}:{line}"

    def _next(self, kind, key, ctx_json):
        k = (kind, ctx_json, key)
        n = self.counts.get(k, 0)
        self.counts[k] = n + 1
        return n

    def _indices(self):
        return [f[3] for f in self.ctx if f[0] == "L"]

    def _top(self):
        if self.ctx and self.ctx[0][0] == "L":
            return _dumps(self.ctx[0][1:3]), self.ctx[0][3]
        return None, None

    # -- loops --------------------------------------------------------------

    def loop(self, iterable, name, frame):
        if self.mode == OFF:
            return iter(iterable)
        key = name or self.site(frame, structural=True)
        ctx_json = _dumps(self.ctx)
        run = self._next("L", key, ctx_json)
        if self.mode == REPLAY and not self.ctx and (key, run) == self.main:
            return self._replay_main(iterable, key, run)
        return self._loop(iterable, key, run)

    def _loop(self, iterable, key, run):
        frame = ["L", key, run, -1]
        depth = len(self.ctx)
        self.ctx.append(frame)
        t0, n = time.perf_counter(), 0
        try:
            for x in iterable:
                frame[3] = n
                n += 1
                yield x
                if depth == 0:
                    self._end_top_iteration()
        finally:
            self.ctx.remove(frame)
            self.loop_stats.append((key, run, depth, n, time.perf_counter() - t0))

    def _replay_main(self, iterable, key, run):
        total = self.plan["iterations"]
        start, end = self.segment
        frame = ["L", key, run, -1]
        self.ctx.append(frame)
        self.phase = "main"
        self.main_seen = True
        it = iter(iterable)
        t0, n = time.perf_counter(), 0
        try:
            while n < min(end, total):
                pseudo = n < start
                self.machine.phase = _core.PSEUDORESUME_PHASE if pseudo else _core.WORK
                self.discard = pseudo  # before fetching the item: its output belongs to it
                frame[3] = n
                try:
                    x = next(it)
                except StopIteration:
                    break
                n += 1
                yield x
                self._end_top_iteration(progress=not pseudo)
        finally:
            self.discard = False
            self.machine.phase = _core.WORK
            self.ctx.remove(frame)
            self.loop_stats.append((key, run, 0, n, time.perf_counter() - t0))
            self.phase = "post"
        if not self.last_part:
            raise SegmentDone(self.part)

    @_accounted
    def _end_top_iteration(self, progress=False):
        if self._line is not None:
            self._emit_line()  # a line left unended belongs to this iteration
        # Counters of finished contexts are never needed again.
        self.counts = {k: v for k, v in self.counts.items() if k[1] == "[]"}
        self._flush()
        if progress and self.progress_fd is not None:
            try:
                os.write(self.progress_fd, f"{self.part} {self.ctx[0][3]}\n".encode())
            except OSError:
                self.progress_fd = None

    # -- blocks -------------------------------------------------------------

    @_accounted
    def step_into(self, name, probed, frame, expect_sig=None) -> bool:
        if self.mode == OFF:
            return True
        where = self.site(frame, structural=True)
        if name is not None:
            first = self.names.setdefault(name, where)
            if first != where:
                raise ValueError(
                    f"SkipBlock name {name!r} is used at {first} and at {where}; "
                    "give each block its own name")
        key = name or where
        handle = self.machine.block(key)
        ctx_json = _dumps(self.ctx)
        occurrence = self._next("B", key, ctx_json)
        payload, load_s = None, 0.0
        if self.mode == REPLAY:
            probed = probed or key in self.probed
            pseudo = self.machine.phase == _core.PSEUDORESUME_PHASE
            if (pseudo or not probed) and key not in self.no_restore:
                t0 = time.perf_counter()
                payload = self._load(key, ctx_json, occurrence)
                load_s = time.perf_counter() - t0
                if payload is not None and expect_sig is not None and \
                        payload["sig"] != expect_sig:
                    if key not in self._sig_noted:
                        self._sig_noted.add(key)
                        _note(f"block {key}: its checkpoints hold {payload['sig']}, the edited "
                              f"script needs {expect_sig}; re-executing it")
                    payload = None
                    self.reexecuted += 1
        state = self.machine.enter(handle, bool(probed), payload is not None)
        if self.mode == REPLAY:
            self.blockruns.append((self.run_id, self.part, self.phase, key, ctx_json,
                                   occurrence, STATE_NAMES[state]))
        self.blocks.append(_Block(handle, key, ctx_json, occurrence, state, payload, load_s))
        self.ctx.append(["B", key, occurrence])
        return state in BODY_RUNS

    def _load(self, key, ctx_json, occurrence):
        fname = self.ckpts.get((key, ctx_json, occurrence))
        where = f"block {key!r} at {json.loads(ctx_json) or 'the top level'}"
        if fname is None:
            self.reexecuted += 1  # record did not checkpoint this execution
            return None
        path = os.path.join(self.ckpt_dir, fname)
        try:
            payload = load(path, map_location="cpu")
        except FileNotFoundError:
            _note(f"checkpoint {fname} is missing; re-executing {where}")
        except CheckpointCorrupt as e:
            _note(f"{e}; re-executing {where}")
        else:
            if (isinstance(payload, dict) and payload.get("block") == key
                    and payload.get("ctx") == ctx_json
                    and payload.get("occurrence") == occurrence):
                return payload
            _note(f"checkpoint {fname} does not belong to {where}; re-executing it")
        self.reexecuted += 1
        return None

    def abandon(self):
        """The innermost block's body raised: close it without a checkpoint."""
        if self.blocks:
            b = self.blocks.pop()
            self.machine.leave(b.handle)
            self.ctx.pop()

    @_accounted
    def end(self, objs, frame, sig=None, rebind=None, as_list=False,
            hint="pass probed=True to its step_into() to re-execute it"):
        """Close the innermost block (see SkipBlock.end).  `sig` names the
        objects (default: their types); `rebind[i]` restores objs[i] by
        returning the saved value instead of updating it in place (objects
        with load_state_dict are always loaded in place)."""
        ret = list if as_list else _ret
        if self.mode == OFF:
            return ret(objs)
        if not self.blocks:
            raise RuntimeError(
                "flor.SkipBlock.end() without a matching flor.SkipBlock.step_into()")
        b = self.blocks.pop()
        state, seconds = self.machine.leave(b.handle)
        self.ctx.pop()
        sig = signature(objs) if sig is None else list(sig)
        if state == _core.EXECUTE:
            self._decide(b, objs, seconds, sig)
            return ret(objs)
        if state == _core.STEP_INTO:
            return ret(objs)
        t0 = time.perf_counter()
        saved = b.payload
        if saved["sig"] != sig:
            raise FlorReplayError(
                f"SkipBlock {b.key!r}: its checkpoint holds {saved['sig']} but end() received "
                f"{sig}. The program changed after record, so flor cannot skip "
                f"this block; {hint}")
        rebind = rebind or [False] * len(objs)
        out = [_rebind(live, s) if again else restore(live, s)
               for live, s, again in zip(objs, saved["objs"], rebind)]
        set_module_modes(out, saved.get("modes"))
        set_rng_state(saved["rng"])
        torch = sys.modules.get("torch")
        for o in out:
            if torch is not None and isinstance(o, torch.optim.Optimizer):
                # The block stepped this optimizer in record; torch's LR
                # schedulers read this flag to warn about a missing step().
                o._opt_called = True
        self.machine.restored(b.handle, b.load_s + time.perf_counter() - t0)
        return ret(out)

    def _decide(self, b, objs, seconds, sig):
        nbytes = self.last_bytes.get(b.key)
        if nbytes is None:
            nbytes = _core.measure(list(objs))
        bw = self.bandwidth()
        ok, reason, ratio, limit, M = self.machine.decide(b.handle, nbytes, bw)
        fname = None
        indices = self._indices()
        if ok:
            fname = checkpoint_name(b.key, b.ctx, b.occurrence, indices)
            payload = {"block": b.key, "ctx": b.ctx, "occurrence": b.occurrence,
                       "sig": sig, "objs": list(objs),
                       "modes": module_modes(objs), "rng": rng_state()}
            try:
                self.last_bytes[b.key] = self._materializer().submit(fname, payload)
            except CheckpointWriteError as e:
                _note(f"checkpoint of block {b.key!r} failed: {e}")
                fname = None
        st = self.machine.stats()[b.handle]
        top, top_iter = self._top()
        self.decisions.append((
            self.run_id, b.key, b.ctx, b.occurrence, json.dumps(indices), top, top_iter,
            st["n"], st["k"], seconds, st["compute_s"] / st["n"], nbytes, bw, M,
            ratio if math.isfinite(ratio) else None, limit, int(ok), reason,
            fname + ".flor" if fname else None))

    def _materializer(self):
        if self._mat is None:
            mode = os.environ.get("FLOR_MATERIALIZER", "thread")
            if mode not in ("thread", "fork", "inline"):
                raise ValueError(f"FLOR_MATERIALIZER must be thread, fork or inline, "
                                 f"not {mode!r}")
            self._mat = Materializer(self.store.ckpt_dir(self.run_id), mode=mode)
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

    @_accounted
    def log(self, name, value, frame):
        if self.mode == OFF or self.discard:
            return
        loc = self.site(frame)
        ctx_json = _dumps(self.ctx)
        seq = self._next("S", (name, loc), ctx_json)
        self.ord += 1
        top, _ = self._top()
        self.pending_logs.append((self.run_id, self.part, self.ord, self.phase, top, ctx_json,
                                  name, json.dumps(self._indices()), seq,
                                  json.dumps(jsonable(value)), loc))

    @_accounted
    def _capture(self, stream, text):
        if self.discard or not text:
            return
        if stream == "stdout":
            self._stdout_lines(text)
        top, it = self._top()
        last = self.pending_out[-1] if self.pending_out else None
        if (last is not None and last[3] == stream and last[4] == self.phase
                and last[5] == top and last[6] == it):
            last[7] += text
            return
        self.ord += 1
        self.pending_out.append([self.run_id, self.part, self.ord, stream, self.phase, top, it,
                                 text])

    def _user_frame(self):
        """The innermost frame running a file of the user's program."""
        f = sys._getframe(3)
        while f is not None:
            fn = f.f_code.co_filename
            mine = self._user_files.get(fn)
            if mine is None:
                path = os.path.abspath(fn)
                mine = self._user_files[fn] = (
                    path == self.script or (path.startswith(self.base + os.sep)
                                            and not path.startswith(_FLOR_DIR)
                                            and "site-packages" not in path))
            if mine:
                return f
            f = f.f_back
        return None

    def _stdout_lines(self, text):
        """Printed lines as values of their statement: ``stdout@file:line``,
        compared by the deferred checks like flor.log values."""
        frame = self._user_frame()
        where = (self.site(frame), _dumps(self.ctx)) if frame is not None else None
        if self._line is not None and self._line[0] != where:
            self._emit_line()
        if where is None:
            return
        if self._line is None:
            self._line = [where, self.phase, self._top()[0], json.dumps(self._indices()), ""]
        self._line[4] += text
        while self._line is not None and "\n" in self._line[4]:
            first, rest = self._line[4].split("\n", 1)
            self._line[4] = first
            self._emit_line()
            if rest:
                self._line = [where, self.phase, self._top()[0], json.dumps(self._indices()),
                              rest]

    def _emit_line(self):
        (loc, ctx_json), phase, top, indices, text = self._line
        self._line = None
        name = f"stdout@{loc}"
        seq = self._next("S", (name, loc), ctx_json)
        self.ord += 1
        self.pending_logs.append((self.run_id, self.part, self.ord, phase, top, ctx_json,
                                  name, indices, seq, json.dumps(text), loc))

    def _flush(self):
        if self.mode == OFF:
            return
        if self._line is not None:
            self._emit_line()
        logs, out, dec, runs = self.pending_logs, self.pending_out, self.decisions, self.blockruns
        self.pending_logs, self.pending_out, self.decisions, self.blockruns = [], [], [], []
        self.store.add_logs(logs)
        self.store.add_output([tuple(r) for r in out])
        self.store.add_decisions(dec)
        self.store.add_blockruns(runs)

    # -- the end ------------------------------------------------------------

    def finish(self, error: BaseException | None = None):
        """Make every checkpoint durable and store what the run measured."""
        if self.finished or self.mode == OFF or self.pid != os.getpid():
            return
        self.finished = True
        error = error if error is not None else self.error
        for stream, real in self._streams.items():
            current = getattr(sys, stream)
            if isinstance(current, Output) and current._session is self:
                current.flush()
                setattr(sys, stream, real)
        if self._hook is not None and sys.excepthook is self._hook[0]:
            sys.excepthook = self._hook[1]
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
        failed = error is not None and not isinstance(error, SegmentDone)
        status = "failed" if failed else "finished"
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else None
        if self.mode == RECORD:
            top = [row for row in self.loop_stats if row[2] == 0]
            main = max(top, key=lambda r: r[4]) if top else None
            self.store.update_run(
                self.run_id, finished=time.time(), status=status,
                main_loop=main[0] if main else None, main_run=main[1] if main else None,
                iterations=main[3] if main else 0, versions=json.dumps(_versions()),
                info=json.dumps({"failed_writes": [f[0] for f in failures], "threads": threads,
                                 "adaptive": self.machine.adaptive,
                                 "hands_free": self.hands_free,
                                 "flor_seconds": self.flor_s,
                                 "captured": self.block_labels,
                                 "error": repr(error) if failed else None}))
        else:
            if not self.main_seen:
                _note(f"the recorded main loop ({self.main[0]}) never ran in this replay; "
                      "the whole script ran in every worker")
            self.store.set_part(self.run_id, self.part, status, time.time() - self.started,
                                {"reexecuted": self.reexecuted, "threads": threads,
                                 "main_seen": self.main_seen,
                                 "captured": self.block_labels,
                                 "error": repr(error) if failed else None})


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
