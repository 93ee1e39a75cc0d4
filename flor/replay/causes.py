"""Why a replay's values differ from the record's: every likely-cause
heuristic of the deferred checks, in one place.

- A printed line that differs from the recorded one only in fields whose
  values come from the clock (flor/replay/clock.py) is not a failure: it
  is set apart as "reads the clock".
- State fingerprints tell where replay first diverged: a block that ran
  again and ended in another state, or an iteration whose end state differs
  although every block that ran again in it ended as in record (then a
  block restored in it did not hold everything it changes).
- The random state at the start of a loop differed: the script draws
  unseeded random numbers (named only when something else differs: a
  script may leave a generator it never uses unseeded).
- A re-executed block ran with another torch thread count than the record.
- The record ran CUDA kernels without deterministic algorithms.
- For a statement that differs: the block restored before it may miss a
  path the statement reads (hands-free), or flor's blocks are not involved.
- Where the edited script changed more than hindsight statements (an
  optimizer's learning rate), that change is named first: where it alters
  the training, a plain run of the edited script differs from the record
  too; the other causes are still looked for.
"""
from __future__ import annotations

import ast
import builtins
import json
import os
import re

from ..context import STATE, STATE_BLOCK, STATE_ENTRY, parse_location
from ..program.analysis import Script
from ..program.syntax import path_of, root
from .clock import clock_fields_only, clock_names, reads_clock, speed_metrics_only

__all__ = ["explain"]

_BUILTINS = set(dir(builtins))


def _statement_at(tree, line):
    best = None
    for n in ast.walk(tree):
        if isinstance(n, ast.stmt) and n.lineno <= line <= (n.end_lineno or n.lineno):
            if best is None or n.lineno >= best.lineno:
                best = n
    return best


def _paths_read(stmt):
    """Objects a statement reads: not the functions it calls, not builtins."""
    called = {id(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
    out = set()
    for n in ast.walk(stmt):
        if id(n) in called and isinstance(n, ast.Name):
            continue
        if isinstance(n, ast.Name) and n.id in _BUILTINS:
            continue
        if id(n) in called and isinstance(n, ast.Attribute):
            n = n.value  # x.method(): the object read is x
        if isinstance(n, (ast.Attribute, ast.Name)) and isinstance(n.ctx, ast.Load):
            p = path_of(n)
            if p is not None:
                out.add(p)
    return out


class _Program:
    """The edited script as the heuristics need it."""

    def __init__(self, source):
        try:
            self.tree = ast.parse(source)
        except SyntaxError:
            self.tree = None
        self.lines = source.splitlines()
        self.not_state = Script(self.tree).not_state if self.tree is not None else set()
        self.clock = clock_names(self.tree) if self.tree is not None else set()

    def statement(self, line):
        stmt = _statement_at(self.tree, line) if self.tree is not None else None
        text = "\n".join(self.lines[stmt.lineno - 1:stmt.end_lineno]) if stmt else ""
        return stmt, text


def explain(report, store, plan, source, rec=None):
    """Fill report.shown_loc (current file:line of each statement), set apart
    clock-only differences (report.clock), and fill report.causes (a likely
    cause per statement that differed) and report.run_causes (causes that
    concern the whole replay)."""
    back = {rel: {v: k for k, v in f.lines.items()} for rel, f in plan.files.items()}
    prog = _Program(source)
    script = os.path.basename(plan.script)
    # The project's modules a hands-free record instrumented: a line they
    # print is the script's as to the clock, and a name or attribute one of
    # them computes from the clock is the clock's wherever it is printed.
    # (their sources as the replay ran them: plan.register kept them)
    kept = store.layout.module_sources(plan.replay_id)
    progs = {script: prog}
    progs.update((rel, _Program(kept[rel])) for rel in (plan.hands_free or {}).get("modules")
                 or [] if rel in kept)
    clock = set().union(*(p.clock for p in progs.values()))

    def current(loc):
        rel, line, new = parse_location(loc)
        cur = line if new else back.get(rel, {}).get(line) if line is not None else None
        report.shown_loc[loc] = f"{rel}:{cur}" if cur else loc
        return rel, cur

    # Differences only in fields that read the clock are not failures.
    for m in list(report.mismatches):
        loc, name, _, _, recorded, replayed = m
        if name.startswith(STATE):
            continue
        rel, cur = current(loc)
        if cur is None or rel not in progs:
            continue
        stmt, text = progs[rel].statement(cur)
        tolerance = plan.tolerance or 0.0
        if (reads_clock(stmt, text, clock)
                and clock_fields_only(stmt, clock, recorded, replayed, tolerance)) \
                or speed_metrics_only(recorded, replayed, tolerance):
            report.mismatches.remove(m)
            report.clock.append(m)
    states = [m for m in report.mismatches if m[1].startswith(STATE)]
    values = [m for m in report.mismatches + report.missing if not m[1].startswith(STATE)]
    other = (plan.hands_free or {}).get("other") or []
    if other and (report.mismatches or report.missing):
        # Named first: where the change alters what the training computes,
        # a plain run of the edited script differs from the record too.
        report.run_causes.append(_changed_cause(other))
    blockruns = store.run_rows("blockruns", plan.replay_id)
    parts = store.parts(plan.replay_id)
    boundary = _boundary_cause(values, plan, parts) if values else None
    for loc in {m[0] for m in values}:
        rel, cur = current(loc)
        if cur is None or rel != script:
            continue
        cause = _statement_cause(report, prog, cur, rel, plan, blockruns, parts)
        if cause is not None and not (boundary and not cause.startswith(_CLOCK)):
            report.causes[loc] = cause  # with a segment start to blame, not the blocks
    for m in states:
        current(m[0])
    if states:
        report.run_causes.append(_state_cause(states, blockruns))
    if boundary:
        report.run_causes.append(boundary)
    if report.mismatches or report.missing:
        for cause in (_random_cause(report, source), _thread_cause(rec, parts, blockruns),
                      _gpu_cause(rec, plan.tolerance)):
            if cause:
                report.run_causes.append(cause)


def _changed_cause(other) -> str:
    lines = ", ".join(str(line) for line, _ in other[:5]) + (", ..." if len(other) > 5 else "")
    return (f"the script changed in ways other than hindsight statements (line"
            f"{'s' if len(other) > 1 else ''} {lines}, listed above): where such a change "
            "alters what the training computes, a plain run of the edited script differs "
            "from the record too; replay with only hindsight statements added to tell")


def _boundary_cause(values, plan, parts):
    """Named when the first main-loop iteration whose values differ is in a
    segment that started from an iteration checkpoint (and no iteration
    before that segment's start differs): the iteration starts from what
    the restore put back, and something it reads is not what the record's
    iteration started from."""
    first = None
    for m in values:
        frames = json.loads(m[2])
        if frames and frames[0][0] == "L" and frames[0][1:3] == [plan.main_loop, plan.main_run]:
            first = frames[0][3] if first is None else min(first, frames[0][3])
    if first is None:
        return None
    for p in parts:
        start, end = plan.segments[p["part"]]
        info = p["info"]
        if start <= first < end and info.resumed_from:
            part, restored, unverified = p["part"], info.restored, info.unverified
            break
    else:
        return None
    put_back = f" ({', '.join(restored)})" if restored else ""
    if unverified:
        put_back += f" (not verified: {'; '.join(unverified)})"
    return (f"the first iteration whose values differ, {first}, is in segment {part}, which "
            f"started from the iteration checkpoint of iteration {start - 1} (earlier "
            f"iterations are equal): the restore put back what the loop carries{put_back} as "
            f"the record had it, but the iterations from {start} on read something else "
            "that was not as the record's: state the loop changes outside what it carries, "
            "or a value the restore put back over one the loop had just bound (its header's "
            "targets)")


_USES = {"torch": None, "numpy": re.compile(r"\b(np|numpy)\.random\b"),
         "random": re.compile(r"^\s*(import random|from random import)", re.M)}


def _random_cause(report, source):
    """Generators whose state at a loop's start differed between the runs:
    torch's (models draw from it), and numpy's or random's when the script
    uses them."""
    for loc, recorded, replayed in report.random:
        differ = sorted(g for g in recorded if recorded[g] != replayed.get(g)
                        and (_USES.get(g) is None or _USES[g].search(source)))
        if differ:
            return (f"the global random state of {' and '.join(differ)} differed between the "
                    f"record and the replay where the loop at {loc} starts: if the script "
                    "draws such random numbers, it draws them without a fixed seed (seed them "
                    "at its start: torch.manual_seed(0), numpy.random.seed(0), random.seed(0))")
    return None


def _state_cause(states, blockruns) -> str:
    """Where the state first diverged, from the fingerprints."""
    order = {STATE_ENTRY: 0, STATE_BLOCK: 1}  # at an iteration: its start, a block's end, its end
    first = min(states, key=lambda m: (json.loads(m[2])[:1], order.get(m[1], 2)))
    loc, name, ctx = first[:3]
    frames = json.loads(ctx)
    where = (f"iteration {frames[0][3]} of the loop at {frames[0][1]}"
             if frames and frames[0][0] == "L" else "the top level")
    if name == STATE_ENTRY:
        return (f"the random state at the start of {where} differed from the record's: a "
                "change before it draws random numbers (a probe that runs the model in "
                "training mode, with dropout, or samples from it), so the training from there "
                "ran again, as a plain run of the edited script trains, and differs from "
                "the record's")
    if name == STATE_BLOCK:
        return (f"block {loc} ran again at {where} and ended in another state than in record: "
                "its computation is not deterministic (unseeded random numbers, the thread "
                "count, GPU kernels) or it reads state that changed before it")
    top = json.dumps(frames[:1], separators=(",", ":"))[:-1]
    restored = sorted({b["block"] for b in blockruns if b["state"] in ("skip", "pseudoresume")
                       and b["ctx"].startswith(top)})
    if restored:
        one = len(restored) == 1
        return (f"the state at the end of {where} differs from the record's, though every "
                f"block that ran again in it ended as in record: the block{'' if one else 's'} "
                f"restored in it ({', '.join(restored)}) may not hold everything "
                f"{'it changes' if one else 'they change'}, such as gradients or state in "
                "another module")
    return (f"the state at the end of {where} differs from the record's: code outside flor's "
            "blocks changed it differently (nondeterminism, other processes or files)")


def _gpu_cause(rec, tolerance):
    """Named when the record ran CUDA kernels without asking torch for
    deterministic algorithms."""
    if rec is None or not rec["info"].cuda or rec["info"].deterministic:
        return None
    fix = ("a larger --tolerance" if tolerance else "compare with --tolerance REL (1e-4, say)")
    return ("the record ran on a GPU without deterministic algorithms: CUDA kernels (cuBLAS, "
            "the atomic adds of some backward passes) differ from run to run in their last "
            f"bits, so code that ran again ends near the record's state, not at it; {fix}, "
            "or record again with torch.use_deterministic_algorithms(True) at the script's "
            "start and CUBLAS_WORKSPACE_CONFIG=:4096:8 in its environment")


def _thread_cause(rec, parts, blockruns):
    """Named only when a block ran again with another thread count."""
    if rec is None:
        return None
    rec_threads = rec["info"].threads
    ran = {b["part"] for b in blockruns if b["state"] == "step_into"}
    used = {p["info"].threads for p in parts if p["part"] in ran}
    used.discard(None)
    if rec_threads is None or not used - {rec_threads}:
        return None
    return (f"blocks ran again with torch using {sorted(used)} intra-op threads, the record "
            f"with {rec_threads}; CPU results match bit for bit only with the same thread "
            "count (set it in the script with torch.set_num_threads)")


_NO_BLOCK = "no block was restored before it"
_CLOCK = "the statement reads the clock"


def _statement_cause(report, prog, cur, rel, plan, blockruns, parts):
    """The likely cause of a difference in the statement at line `cur`."""
    stmt, text = prog.statement(cur)
    if reads_clock(stmt, text, prog.clock):
        return f"{_CLOCK}, so its values differ between runs"
    hands_free = plan.hands_free or {}
    restored = {b["block"] for b in blockruns if b["state"] in ("skip", "pseudoresume")}
    blocks = [b for b in hands_free.get("blocks", []) if b["key"] in restored]
    # A block of the statement's file before it (line numbers of one file);
    # else any restored block, named by its own key.
    before = [b for b in blocks if b["line"] < cur and b["key"].startswith(rel + ":")] \
        or blocks
    if not before:
        if not hands_free:
            return None
        if hands_free.get("other"):
            return (f"{_NO_BLOCK}: the difference comes from outside flor's blocks (the "
                    "script's change named below, nondeterminism, the clock, other processes "
                    "or files)")
        return (f"{_NO_BLOCK}: the difference comes from outside flor's blocks "
                "(nondeterminism, the clock, other processes or files)")
    captured = {}  # block -> what the replay captured, completion included
    for part in parts:
        for key, labels in part["info"].captured.items():
            for label in labels:
                for name in label.split(":", 1)[0].split(", "):
                    captured.setdefault(key, set()).add(name.removeprefix("global "))
    b = max(before, key=lambda b: b["line"])
    held = sorted(set(b["names"] + b["paths"] + b["globals"]) | captured.get(b["key"], set()))
    suspects = []
    for p in sorted(_paths_read(stmt)) if stmt else []:
        r = root(p)
        if r not in b["reads"] or (p == r and r in prog.not_state):
            continue
        if any(p == h or p.startswith(h + ".") or p.startswith(h + "[") for h in held):
            continue
        if any(q != p and q.startswith(p + ".") for q in _paths_read(stmt) if root(q) == r):
            continue  # report the longest path read
        suspects.append(p)
    where = b["key"]  # (file:line of the recorded file)
    if suspects:
        return (f"the side-effect set of the block at {where} may be "
                f"missing {', '.join(f'`{x}`' for x in suspects)}")
    return (f"the side-effect set of the block at {where} (restored from a checkpoint) "
            f"may be incomplete; it holds {', '.join(held) or 'only the random state'}. "
            "State changed where flor cannot see it (another module's code, a C "
            "extension) is not captured")
