"""Identity: where in a run a value, a printed line or a checkpoint belongs.

A *context* is the list of frames enclosing a point of the program,
outermost first:

    ["L", loop, run, i]        iteration i of the run-th run of `loop` (counted
                               among the runs of that loop in its own context)
    ["B", block, occurrence]   the occurrence-th execution of `block` (counted
                               among that block's executions in its context)

It is stored as compact JSON: the ``ctx`` column of flor.db and the
``"ctx"`` field of every block checkpoint.  A block or loop that runs several
times per iteration (inside a helper called twice) gets one context per run,
and a block skipped in replay leaves the numbering of what follows unchanged.

A *location* names a statement: ``file:line`` in the recorded file's line
numbers, or ``file:new:line`` for a line that exists only in the edited
file that replay runs.  Paths are relative to the script's directory.

A value's *name* is what the user logged, or one of the names below: a
printed statement (``stdout@file:line``; a statement that replay added,
by its function and text: flor/statements.py), a TensorBoard scalar (``tb:tag``),
a logging record (``log:logger``), a state fingerprint (``state@...``).  A
replay worker's *phase* says where its script is: before, in or after the
main loop (None in a record).

This module is the one encoder and parser of contexts and locations, and
the one spelling of names and phases; the live stack of a running session
is a `Context`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import NamedTuple

__all__ = ["LOOP", "BLOCK", "Context", "encode", "decode", "top_key", "is_outermost",
           "enclosing_blocks", "describe", "location", "parse_location", "checkpoint_name",
           "block_context", "within", "iteration_key", "is_iteration",
           "PRINTED", "TB", "LOG", "STATE", "STATE_BLOCK", "STATE_ITERATION", "STATE_RANDOM",
           "STATE_ENTRY",
           "PRE", "MAIN", "POST", "Where", "iter_column"]

LOOP, BLOCK = "L", "B"

PRINTED = "stdout@"  # + location: the lines a statement printed
TB = "tb:"  # + tag: SummaryWriter.add_scalar(s)
LOG = "log:"  # + logger name: logging records
STATE = "state@"  # the state fingerprints the deferred checks compare (never results):
STATE_BLOCK = "state@block"  # what a block execution captured, at its end()
STATE_ITERATION = "state@iteration"  # the training state in scope at an iteration's end
STATE_RANDOM = "state@random"  # the random states a top-level loop starts with
STATE_ENTRY = "state@entry"  # the random states a training library's epoch starts with

PRE, MAIN, POST = "pre", "main", "post"  # a replay worker's phases


def encode(frames) -> str:
    return json.dumps(frames, separators=(",", ":"))


def decode(text: str) -> list:
    return json.loads(text)


def top_key(loop, run) -> str:
    """The encoded main-loop run ``[loop, run]`` (the ``top`` column)."""
    if type(loop) is str and type(run) is int:
        return _top_key(loop, run)
    return encode([loop, run])


@functools.lru_cache(maxsize=4096)
def _top_key(loop: str, run: int) -> str:
    return encode([loop, run])


@functools.lru_cache(maxsize=4096)
def _head(kind: str, key: str, n: int) -> str:
    """A frame's encoding up to its loop index: ``["L","train.py:40",0``
    (a block frame's, less its closing bracket)."""
    return encode([kind, key, n])[:-1]


def _frame_text(frame) -> str:
    """encode(frame) of a loop or block frame, from its cached head when its
    key is a str and its number an int (1, 1.0 and True are one key to a
    cache): a session encodes its context at every iteration of every
    tracked loop."""
    if type(frame[1]) is str and type(frame[2]) is int and \
            (len(frame) == 3 or type(frame[3]) is int):
        head = _head(frame[0], frame[1], frame[2])
        return f"{head},{frame[3]}]" if len(frame) == 4 else head + "]"
    return encode(list(frame))


def is_outermost(ctx: str) -> bool:
    """Whether a block execution at `ctx` is nested in no other block."""
    return not any(frame[0] == BLOCK for frame in decode(ctx))


def enclosing_blocks(ctx: str) -> list[tuple[str, str, int]]:
    """(block, its own context, occurrence) of every block around `ctx`."""
    frames = decode(ctx)
    return [(f[1], encode(frames[:i]), f[2]) for i, f in enumerate(frames) if f[0] == BLOCK]


def iteration_key(loop: str) -> str:
    """The key under which a main loop's iteration checkpoints are decided
    and stored (a block key never ends with it)."""
    return f"{loop} (iteration)"


def is_iteration(block: str) -> bool:
    return block.endswith(" (iteration)")


def epoch_key(loop: str) -> str:
    """The key of the block a training library's epoch is (flor/lightning.py)
    in the main loop `loop`."""
    return f"{loop} (epoch)"


def is_epoch(block: str) -> bool:
    return block.endswith(" (epoch)")


def block_context(ctx: str, key: str, occurrence: int) -> str:
    """The context inside a block execution that runs in `ctx`."""
    return encode(decode(ctx) + [[BLOCK, key, occurrence]])


def within(ctx: str, outer: str) -> bool:
    """Whether `ctx` is `outer` or nested inside it."""
    return ctx == outer or ctx.startswith(outer[:-1] + ",")


def describe(ctx: str, seq: int = 0) -> str:
    """``iteration 3 of the loop at train.py:40 > block train #1``."""
    parts = [f"iteration {f[3]} of the loop at {f[1]}" if f[0] == LOOP else f"block {f[1]}"
             for f in decode(ctx)]
    return (" > ".join(parts) or "top level") + (f" #{seq}" if seq else "")


def location(rel: str, line: int, recorded: int | None = None, mapped: bool = False) -> str:
    """The location of `line` of file `rel`.  When the file was mapped
    (`mapped`, in replay), `recorded` is its line in the recorded file, or
    None for a line that replay added."""
    if not mapped:
        return f"{rel}:{line}"
    return f"{rel}:{recorded}" if recorded is not None else f"{rel}:new:{line}"


def statement_at(where) -> str:
    """How a changed statement's place is shown: ``line N`` of the script,
    or the location ``file:N`` of a line in a module of the project."""
    return f"line {where}" if isinstance(where, int) or where is None else str(where)


def parse_location(loc: str) -> tuple[str, int | None, bool]:
    """(file, line, new) of a location; line is None if it is not a number."""
    rel, _, line = loc.rpartition(":")
    new = rel.endswith(":new")
    if new:
        rel = rel[:-4]
    return rel, int(line) if line.isdigit() else None, new


def checkpoint_name(key: str, ctx: str, occurrence: int, indices) -> str:
    """The file name (without .flor) of a block execution's checkpoint."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("._")[:40] or "block"
    where = ".".join(map(str, indices)) or "top"
    digest = hashlib.sha1(f"{key}\0{ctx}\0{occurrence}".encode()).hexdigest()[:10]
    return f"{slug}@{where}-{digest}"


class LoopFrame(list):
    """["L", loop, run, i]: the index is updated in place as the loop runs.
    `scope` is the frame running the loop, while it runs."""

    # handle: of the block an iteration of a main loop is, while it runs;
    # t0: when an iteration the rule is not asked at began (recording.py);
    # ran: the blocks that ran in its last iteration; own: flor's seconds at
    # its iterations (loops.py); ask: whether the rule is asked at the end of
    # the iteration running; encoded: (head, top) of Context.where(), as one
    # loop frame alone makes it (None: made as any other)
    __slots__ = ("scope", "carrier", "handle", "t0", "ran", "own", "ask", "encoded")


class BlockFrame(list):
    """["B", block, occurrence], with what the session knows of the open
    block: the context it runs in, its handle in the C state machine, its
    state, the checkpoint loaded for it (replay) and the seconds that took;
    in record, what it wrote to files (runtime/filewrites.py), once it did."""

    __slots__ = ("ctx", "handle", "state", "payload", "load_s", "writes")

    @property
    def key(self):
        return self[1]

    @property
    def occurrence(self):
        return self[2]


class _Plain:
    """A hands-free block that runs as ordinary code (its loop is not
    tracked here): open, but not part of the identity."""

    __slots__ = ()


PLAIN = _Plain()


class Context:
    """The stack of open loops and blocks of a session, and the counters
    that number loop runs, block occurrences and repeated values within
    each context."""

    def __init__(self, on_change=None):
        self.frames: list = []  # LoopFrame, BlockFrame and PLAIN, outermost first
        self.counts: dict[tuple, int] = {}
        self._top_counts = 0  # of them, those of the top level ("[]")
        self.on_change = on_change or (lambda: None)  # called after every change of identity

    def _identity(self):
        return [f for f in self.frames if f is not PLAIN]

    def encode(self) -> str:
        """encode(self._identity()), frame by frame."""
        return "[" + ",".join([_frame_text(f) for f in self.frames if f is not PLAIN]) + "]"

    def next(self, kind: str, key, ctx: str) -> int:
        """Number the next `kind` ("L" loop run, "B" block occurrence, "S"
        a value's sequence) of `key` in context `ctx`, from 0."""
        k = (kind, ctx, key)
        n = self.counts.get(k, 0)
        self.counts[k] = n + 1
        if n == 0 and ctx == "[]":
            self._top_counts += 1
        return n

    def forget_finished(self):
        """Counters of contexts inside a finished main-loop iteration are
        never needed again."""
        counts = self.counts
        if len(counts) > self._top_counts:
            self.counts = {k: v for k, v in counts.items() if k[1] == "[]"}
            self._top_counts = len(self.counts)

    def depth(self) -> int:
        """Open loops and blocks, not counting plain ones."""
        return len(self._identity())

    def at_top_level(self) -> bool:
        return not self._identity()

    def innermost_loop(self):
        """The key of the innermost frame if it is a loop, else None."""
        frames = self._identity()
        return frames[-1][1] if frames and frames[-1][0] == LOOP else None

    def indices(self) -> list[int]:
        return [f[3] for f in self.frames if f is not PLAIN and f[0] == LOOP]

    def where(self, phase) -> "Where":
        """The Where of the context as it is now, in `phase`."""
        frames = self.frames
        if len(frames) == 1 and type(frames[0]) is LoopFrame and frames[0].encoded is not None \
                and type(frames[0][3]) is int:  # a step loop's every iteration
            f = frames[0]
            head, top = f.encoded
            i = f[3]
            return Where(phase, f"{head}{i}]]", top, i, (i,))
        top, it = self.top()
        return Where(phase, self.encode(), top, it, tuple(self.indices()))

    def top(self):
        """(encoded [loop, run], index) of the outermost loop, or (None, None)."""
        frames = self._identity()
        if frames and frames[0][0] == LOOP:
            return top_key(frames[0][1], frames[0][2]), frames[0][3]
        return None, None

    # -- the stack --------------------------------------------------------

    def push_loop(self, key, run, scope=None) -> LoopFrame:
        frame = LoopFrame([LOOP, key, run, -1])
        frame.scope, frame.carrier, frame.handle = scope, None, None
        frame.t0, frame.ran, frame.own, frame.ask = None, 0, 0.0, True
        frame.encoded = ("[" + _head(LOOP, key, run) + ",", top_key(key, run)) \
            if type(key) is str and type(run) is int else None
        self.frames.append(frame)
        self.on_change()
        return frame

    def set_index(self, frame: LoopFrame, i: int):
        """A loop moves to its iteration i."""
        frame[3] = i
        self.on_change()

    def remove(self, frame):
        """Close a loop (its generator may finish after inner frames closed)."""
        frame.scope = frame.carrier = None
        self.frames.remove(frame)
        self.on_change()

    def push_block(self, key, occurrence, ctx, handle, state, payload, load_s) -> BlockFrame:
        """Open a block execution; `ctx` is the encoded context it runs in."""
        frame = BlockFrame([BLOCK, key, occurrence])
        frame.ctx = ctx
        frame.handle, frame.state, frame.payload, frame.load_s = handle, state, payload, load_s
        frame.writes = None
        self.frames.append(frame)
        self.on_change()
        return frame

    def push_plain(self):
        self.frames.append(PLAIN)

    def innermost_block(self):
        """The innermost open block: a BlockFrame, PLAIN, or None."""
        for f in reversed(self.frames):
            if f is PLAIN or isinstance(f, BlockFrame):
                return f
        return None

    def pop_block(self):
        """Close the innermost open block and return it (BlockFrame or PLAIN),
        or None when no block is open."""
        for i in range(len(self.frames) - 1, -1, -1):
            f = self.frames[i]
            if f is PLAIN or isinstance(f, BlockFrame):
                del self.frames[i]
                if f is not PLAIN:
                    self.on_change()
                return f
        return None


def printed_lines(output: list[dict], name=None) -> list[dict]:
    """Log rows of the lines printed on stdout by statements of the user's
    program, from output rows in order.  A line is a value of the statement
    that printed it, named ``name(loc)`` (``stdout@`` + its location when
    not given: flor/statements.py names a replay's added lines); one that a
    statement leaves unended is a value of its own when another statement
    (or the same one in another context) writes next, or when output not
    of the user's program does."""
    out, counts, indices = [], {}, {}
    pending = None  # (row where a line not yet ended began, its text so far)

    def emit(row, text):
        ctx = row["ctx"]
        key = (row["loc"], ctx)
        seq = counts.get(key, 0)
        counts[key] = seq + 1
        if ctx not in indices:  # lines share contexts by the thousand
            indices[ctx] = _indices(ctx)
        out.append({"run_id": row["run_id"], "part": row["part"], "ord": row["ord"],
                    "phase": row["phase"], "top": row["top"], "ctx": ctx,
                    "name": name(row["loc"]) if name else PRINTED + row["loc"],
                    "iter": indices[ctx], "seq": seq, "value": json.dumps(text), "loc": row["loc"]})

    for row in output:
        if row["stream"] != "stdout":
            continue
        if pending is not None and (row["loc"], row["ctx"]) != (pending[0]["loc"],
                                                                pending[0]["ctx"]):
            emit(*pending)
            pending = None
        if row["loc"] is None:
            continue
        lines = row["text"].split("\n")
        for i, line in enumerate(lines[:-1]):
            if i == 0 and pending is not None:
                emit(pending[0], pending[1] + line)
                pending = None
            else:
                emit(row, line)
        if lines[-1]:
            pending = (pending[0], pending[1] + lines[-1]) if pending else (row, lines[-1])
    if pending is not None:
        emit(*pending)
    return out


@functools.lru_cache(maxsize=4096)
def _indices(ctx):
    """The `iter` column of a context: the indices of its loops."""
    return iter_column(f[3] for f in json.loads(ctx or "[]") if f[0] == "L")


def iter_column(indices) -> str:
    """The `iter` column of logs and decisions: the JSON list of the
    indices of a context's loops, outermost first (json.dumps of the
    list, spelt out for ints: it is made for every decision)."""
    indices = list(indices)
    if all(type(i) is int for i in indices):
        return "[" + ", ".join(map(str, indices)) + "]"
    return json.dumps(indices)


class Where(NamedTuple):
    """Where the run is: what every value and output row is stored with,
    kept current by the session at each change of context."""

    phase: str | None  # PRE, MAIN, POST in replay; None in record
    ctx: str  # the context, encoded
    top: str | None  # the outermost loop, encoded [loop, run] (None: outside loops)
    top_iter: int | None  # its index
    indices: tuple  # the index of each loop of the context, outermost first
