"""What a checkpoint costs training: the M of the adaptive rule.

A checkpoint costs the training thread what it blocks in ``submit`` (the
snapshot copy, and waiting when the staging buffer is full), plus the
slowdown of the block executions that run while the background write is in
progress (the writer competes for cores and memory bandwidth).
The background write itself is not charged: training does not wait for it.

Both parts are measured.  The blocking is the time `submit` takes.  An
execution of a block that started or ended with a write in progress is
*overlapped*; its slowdown is its own compute time (less the blocks nested
in it) beyond the block's mean over executions that were not, and it is
charged to the block whose checkpoint was being written.  A writer cannot
take from training more core time than it runs, so an execution's slowdown
is at most the CPU time the writer used while it ran (less what nested
executions were charged of it): the slower steps of a script whose steps
drift, or of a machine that a neighbour loads, are not the checkpoint's
cost.  What the writer costs training without using a core is not
charged: a training step that does its own disk I/O while the writer
waits for the disk (each file is synced) is slowed beyond that bound.  (A
fork-mode writer's CPU time is known once its child is reaped, too late to
bound the executions it overlapped: there no bound applies.)
The rule then asks whether the training overhead after one more checkpoint
stays within the bound:

    spent + marginal < n * epsilon * C      i.e.   M = (spent + marginal) / (k + 1)

where `spent` is what the block's k checkpoints have cost so far, with
what the checkpoints of blocks nested in its executions blocked (C, its
mean compute time, holds theirs: an outer block and an inner one that
checkpoint the same state would otherwise each spend epsilon of the inner
block's time), and `marginal` what the next one is expected to cost: the smallest blocking
measured (the staging buffer is warm after the first) plus the mean
slowdown per checkpoint.  Before a warm checkpoint of a block is measured,
the blocking is predicted by a model: a warm copy of its bytes (the
calibrated copy bandwidth) plus a fraction of the write time, 1/4 when the
writer has a core that training does not use and all of it otherwise.
Bytes in CUDA tensors are modelled apart: training pays for them a copy
within the device (flor/_cuda.py; DEVICE_COPY_BPS), and the writer's work
competes with a host thread that mostly waits for the GPU, so no share of
their write is charged before a slowdown is measured.  The first
checkpoint's own blocking includes one-time costs (the staging buffer's
first touch), so it caps the model's figure rather than replacing it; what
it cost stays in `spent`.
"""
from __future__ import annotations

import math
import os
import sys
import time

from .. import _core

__all__ = ["Charges", "StateReads", "Waits", "reason", "UNCAPTURED"]

#: How the reason of a decision not to checkpoint a state that cannot be
#: read or copied says so (recording.py notes it once, when it happens).
UNCAPTURED = "cannot be checkpointed"

SPARE_CORE_SHARE = 0.25  # of the write time, charged before any measure
# What training pays per byte of a CUDA tensor before a checkpoint is
# measured: the staged copy within the device runs at over 1e12 B/s on
# current GPUs, and flor's side of the call is about 1 ms per GiB
# (docs/benchmarks.md, "The CUDA path on a GPU"); 1e11 B/s covers both.
DEVICE_COPY_BPS = 1e11


class _Block:
    __slots__ = ("blocking", "total", "least", "slowdown", "clean_s", "clean_n", "nested")

    def __init__(self):
        self.blocking: list[float] = []  # per checkpoint
        # sum(blocking) and min(blocking), made again as it changes (the
        # builtin sum, as the rule always summed): the rule reads them at
        # every execution, and a step loop has thousands of checkpoints
        self.total, self.least = 0.0, math.inf
        self.slowdown = 0.0  # total, over overlapped executions
        self.clean_s, self.clean_n = 0.0, 0  # own compute of executions with no write going on
        self.nested = 0.0  # what checkpoints of blocks nested in its executions blocked

    def charge(self, blocking: float):
        """A checkpoint blocked `blocking` seconds."""
        self.blocking.append(blocking)
        self.total, self.least = sum(self.blocking), min(self.least, blocking)

    def pay_last(self, seconds: float):
        """The last checkpoint cost `seconds` more."""
        self.blocking[-1] += seconds
        self.total, self.least = sum(self.blocking), min(self.blocking)

    @property
    def spent(self) -> float:
        return self.total + self.slowdown


class _Frame:
    """An open block execution."""
    __slots__ = ("key", "writer", "inner", "cpu", "granted")

    def __init__(self, key, writing):
        self.key, self.writer = key, writing.block  # the block being written when it started
        self.cpu = writing.cpu  # the writers' CPU seconds then (None: not known in time)
        self.inner = 0.0  # seconds of nested executions and their checkpoints' blocking
        self.granted = 0.0  # of the writers' CPU while it ran, charged to nested executions


def _share() -> float:
    """The share of the write time charged before anything is measured."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return SPARE_CORE_SHARE if cores > threads else 1.0


class Charges:
    """The cost of each block's checkpoints to the training thread.

    A block's own time excludes the blocks nested in it and their
    checkpoints' blocking; slowdown goes to the block whose checkpoint was
    being written (`writing`: runtime/writes.py's Writing, taken as the
    execution starts and ends)."""

    def __init__(self):
        self._blocks: dict[str, _Block] = {}
        self._open: list[_Frame] = []
        self._share = None

    def _block(self, key) -> _Block:
        b = self._blocks.get(key)
        if b is None:
            b = self._blocks[key] = _Block()
        return b

    def started(self, key, writing):
        """A block execution starts."""
        self._open.append(_Frame(key, writing))

    def ended(self, key, seconds: float, writing):
        """A block execution ended after `seconds` (nested blocks included)."""
        b = self._block(key)
        frame, lost = None, 0.0
        while self._open:  # executions left open by an exception end with this one
            f = self._open.pop()
            if f.key == key:
                frame = f
                frame.granted += lost  # what was charged within them stays charged
                break
            lost += f.granted
        parent = self._open[-1] if self._open else None
        if parent is not None:
            parent.inner += seconds
        if frame is None:
            return
        own = seconds - frame.inner
        overlapped = writing.block or frame.writer
        extra = 0.0
        if overlapped is None:
            b.clean_s += own
            b.clean_n += 1
        elif b.clean_n:
            extra = own - b.clean_s / b.clean_n
            if frame.cpu is not None and writing.cpu is not None:
                extra = min(extra, writing.cpu - frame.cpu - frame.granted)
            if extra > 0:
                self._block(overlapped).slowdown += extra
        if parent is not None:
            parent.granted += frame.granted + max(extra, 0.0)

    def clean(self, key, seconds: float, count: int = 1):
        """`count` executions of `key` took `seconds` in all, each timed
        alone: no write was in progress as it started, and no block ran in
        it (several: a run of a step loop's quiet iterations)."""
        b = self._block(key)
        b.clean_s += seconds
        b.clean_n += count

    def cost(self, key, nbytes: int, copy_bw: float, write_s: float,
             on_device: float = 0.0) -> float:
        """M for the rule: the block's training overhead after one more
        checkpoint of `nbytes`, a fraction `on_device` of them in CUDA
        tensors, per checkpoint."""
        b = self._block(key)
        k = len(b.blocking)
        if self._share is None:
            self._share = _share()
        host = 1.0 - on_device
        prior = nbytes * (host / copy_bw + on_device / DEVICE_COPY_BPS) + \
            self._share * write_s * host
        if k == 0:
            marginal = prior
        elif k == 1:
            # The first checkpoint also paid one-time costs (its staging
            # buffer's pages): until a warm one is measured, the model of a
            # warm one, capped by what the cold one cost.
            marginal = min(prior, b.blocking[0]) + b.slowdown
        else:
            marginal = b.least + b.slowdown / k
        return (b.spent + b.nested + marginal) / (k + 1)

    def blocked(self, key) -> float:
        """What the block's checkpoints have blocked training so far."""
        b = self._blocks.get(key)
        return b.total if b is not None else 0.0

    def paid(self, key, seconds: float):
        """Training paid `seconds` more for the checkpoint of the block just
        charged (its state fingerprint, taken after the submit)."""
        b = self._block(key)
        if b.blocking:
            b.pay_last(seconds)
        self._nested(key, seconds)

    def charged(self, key, blocking: float):
        """A checkpoint of the block was submitted; it blocked `blocking` s."""
        self._block(key).charge(blocking)
        self._nested(key, blocking)

    def abandoned(self, key):
        """An execution of `key` ended with no end() (an exception or a
        break left it): it is no longer open; the writer's CPU charged
        within it stays charged."""
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].key == key:
                lost = sum(f.granted for f in self._open[i:])
                del self._open[i:]
                if self._open:
                    self._open[-1].granted += lost
                return

    def _nested(self, key, seconds):
        """A checkpoint of `key` nested in the open executions blocked
        `seconds`: not the innermost one's own time, and part of the
        overhead of every enclosing block (once each; not of `key` itself
        when it is open around its own execution: its own blocking holds it)."""
        if self._open:
            self._open[-1].inner += seconds
        for outer in {f.key for f in self._open} - {key}:
            self._block(outer).nested += seconds


def reason(machine, nbytes: int, write_s: float, decided, spent: float = 0.0) -> str:
    """The adaptive rule's decision for one block execution, in words, from
    what SkipMachine.decide() returned (`decided`: the decision, the ratio
    and limit of the half that binds, M, and the terms both halves
    compared; the C rule gives numbers, this gives the words); `spent`, B:
    flor's other seconds at the block's executions."""
    _, ratio, limit, M, (cheap, worth, C, n, k, oratio, _, rratio, rlimit) = decided
    if not machine.adaptive:
        would = "checkpoint" if cheap and worth else "not checkpoint"
        return f"checkpoint: adaptivity off (the rule would {would}: M/C = {ratio:.4g} " \
               f"vs limit {limit:.4g})"
    if spent:
        measured = f"(M + B/(k+1))/C = {oratio:.4g} (M = {M:.4g} s for {nbytes} B, B = " \
                   f"{spent:.4g} s of flor's own at {n} iterations, C = {C:.4g} s)"
    else:
        measured = f"M/C = {oratio:.4g} (M = {M:.4g} s for {nbytes} B, C = {C:.4g} s)"
    if not cheap:
        return f"no checkpoint: {measured} >= n/(k+1) * eps = {n}/{k + 1} * " \
               f"{machine.epsilon:.4g} = {limit:.4g}"
    return f"{'checkpoint' if worth else 'no checkpoint'}: {measured} < n/(k+1) * eps; " \
           f"(M + c*W)/C = {rratio:.4g} (c = {machine.c:.4g}, W = {write_s:.4g} s) " \
           f"{'<' if worth else '>='} n/(k+1) = {n}/{k + 1} = {rlimit:.4g}"


class Waits:
    """Iterations of a step loop at which the rule is not asked.

    Asking the rule at every iteration of a loop costs its decision and
    stored row each time; on a loop of millisecond steps that alone is
    several times what the bound allows.  Each time it is asked, the
    executions it needs before it can say yes (again) follow from the numbers
    it compared, as long as M, C and flor's other time per execution,
    b = B/n, stay as they are: the overhead half,
    (k+1) * M + b * n < n * epsilon * C, holds from
    n >= (k+1) * M / (epsilon * C - b) (never where b is at least
    epsilon * C: flor's bookkeeping alone is then all the bound allows),
    the replay half from n >= (k+1) * (M + R) / C.  The rule is asked again
    after three quarters of them, and by 2n at the latest: M only grows until
    the next checkpoint (the slowdown of executions overlapping a write is
    charged as they end), so an earlier ask says no again; C may grow (a
    drifting step, a slow evaluation step), and asking after three quarters
    of what is left each time keeps a checkpoint that became due from
    waiting long.  An ask costs flor time too, which B holds: near the
    point where the rule can say yes, asks come at most every so many
    iterations that they take ASKS of what the bound allows (asked at every
    one, they would push that point on as fast as the loop nears it).  An
    iteration the rule is not asked at leaves no decision row; its
    execution is counted (n, C) all the same."""

    SHARE = 0.75
    ASKS = 0.1  # of epsilon * C, at most, for asking the rule

    def __init__(self):
        self._left: dict[str, int] = {}

    def waiting(self, key) -> bool:
        """Whether the rule is not asked at this execution of `key`."""
        left = self._left.get(key, 0)
        if left <= 0:
            return False
        self._left[key] = left - 1
        return True

    def left(self, key) -> int:
        """How many of the next executions of `key` the rule is not asked at."""
        return max(self._left.get(key, 0), 0)

    def used(self, key, count: int):
        """`count` executions of `key` began without asking whether to wait
        (waiting() of each)."""
        left = self._left.get(key, 0)
        if left > 0:
            self._left[key] = max(left - count, 0)

    def asked(self, key, decided, epsilon: float, spent: float = 0.0, ask_s: float = 0.0):
        """The rule was asked about `key` (`decided`: what
        SkipMachine.decide() returned, given `spent`, B; the ask took
        `ask_s`): skip the next asks that cannot say yes (after a yes, with
        one checkpoint more)."""
        yes, _, _, M, (_, _, C, n, k, _, _, rratio, _) = decided
        k += bool(yes)
        room = epsilon * C - spent / n
        need = max((k + 1) * M / room if room > 0 else math.inf, rratio * (k + 1))
        gap = min(need - n, n)  # (at most n: asked again by 2n, whatever M/C was)
        least = ask_s / (self.ASKS * epsilon * C) if C > 0 else 0.0
        self._left[key] = int(min(max(gap * self.SHARE, least), n))


class StateReads:
    """What the rule knows of each block's state between reads of it: its
    bytes (of its last checkpoint, or as last measured) and share on the
    GPU, and what no checkpoint of it holds.  Reading a state (capturing
    it, walking it) costs a step loop about what a step does, so it is read
    to measure it at most once every `every` seconds, and where the rule
    checkpoints it."""

    def __init__(self, every: float):
        self.every = every
        self.nbytes: dict[str, int] = {}
        self.on_device: dict[str, float] = {}
        self.unheld: dict[str, list] = {}
        self.uncaptured: dict[str, str] = {}  # why a state cannot be checkpointed
        self._at: dict[str, float] = {}  # when last measured (time.monotonic())

    def size(self, key, objs, measure, keep=True) -> tuple[int, bool]:
        """(bytes of `key`'s state, whether measured now by `measure(objs())`,
        which returns (bytes, bytes on the GPU)); `keep`: remember it."""
        nbytes = self.nbytes.get(key) if keep else None
        now = time.monotonic()
        if nbytes is not None and now - self._at.get(key, -math.inf) < self.every:
            return nbytes, False
        nbytes, on_device = measure(objs())
        self.on_device[key] = on_device / nbytes if nbytes else 0.0
        self._at[key] = now
        if keep:
            self.nbytes[key] = nbytes
        return nbytes, True

    def written(self, key, nbytes):
        """A checkpoint of `key`'s state wrote `nbytes`."""
        self.nbytes[key], self._at[key] = nbytes, time.monotonic()

    def cannot_capture(self, key, named, error) -> str:
        """Reading or copying `key`'s state raised `error` (pickle cannot
        reduce an object of it, say): it is never checkpointed again, and
        replay runs it again.  Returns why, naming the object of `named()`
        ([(label, object)]) that cannot be read alone, else the error as
        raised (with the walk's path)."""
        culprit = None
        try:
            for label, obj in named():
                try:
                    _core.measure(obj, True)
                except Exception as e:  # noqa: BLE001 -- any failure names it
                    kind = "" if "(a " in label else f" (a {_type_name(obj)})"
                    culprit = f"{label}{kind} {UNCAPTURED}: {_said(e)}{_inside(e, label)}"
                    break
        except Exception as e:  # noqa: BLE001 -- the state cannot even be listed
            culprit = f"its state {UNCAPTURED}: listing it raised {_said(e)}"
        if culprit is None:
            culprit = f"its state {UNCAPTURED}: {_said(error, notes=True)}"
        self.uncaptured[key] = culprit
        return culprit

    def unheld_of(self, key, unheld, fresh: bool, wanted: bool) -> list:
        """What no checkpoint of `key`'s state holds: `unheld()` where its
        size was `fresh`ly measured, or never asked before, or where a
        checkpoint is `wanted` and the last read found all of it held; else
        as last read (a step loop carrying an iterator is not read again at
        every step the rule would checkpoint)."""
        last = self.unheld.get(key)
        if fresh or last is None or (wanted and not last):
            self.unheld[key] = last = unheld()
        return last


def _type_name(obj) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_WALK_NOTE = "while taking a flor snapshot of obj"


def _inside(e: BaseException, label: str) -> str:
    """Where inside the object labelled `label` the walk failed, from its
    note (``obj['_lock']`` becomes `` (at acc['_lock'])``), or ""."""
    for n in getattr(e, "__notes__", None) or ():
        if n.startswith(_WALK_NOTE) and len(n) > len(_WALK_NOTE):
            return f" (at {label.split(' (', 1)[0]}{n[len(_WALK_NOTE):]})"
    return ""


def _said(e: BaseException, notes=False) -> str:
    """An exception as one line: its type and message (and notes)."""
    text = f"{type(e).__name__}: {e}"
    if notes and getattr(e, "__notes__", None):
        text += " (" + "; ".join(e.__notes__) + ")"
    return text
