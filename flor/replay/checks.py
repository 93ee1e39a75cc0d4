"""Deferred checks: the replay's values against the record's, and every
likely-cause heuristic for a difference.

A value is identified by its statement (its location, in recorded line
numbers), its context (the enclosing loop iterations and block executions,
flor/context.py) and its count within that context.  Every value that both
runs logged is compared, and a value the record logged is reported missing
when the replay should have logged it too: its statement is still in the
program and every block execution around it ran again.
"""
from __future__ import annotations

import ast
import builtins
import json
import math
import os
import re
from dataclasses import dataclass, field

from ..context import describe, enclosing_blocks, parse_location
from ..program.analysis import Script
from ..program.syntax import path_of, root
from .plan import Plan

__all__ = ["compare_logs", "CheckReport", "equal", "explain"]

RAN = ("step_into", "execute")


@dataclass
class CheckReport:
    compared: int = 0
    lines: int = 0  # of which printed lines
    mismatches: list = field(default_factory=list)  # (loc, name, ctx, seq, recorded, replayed)
    missing: list = field(default_factory=list)  # (loc, name, ctx, seq, recorded)
    ambiguous: int = 0
    causes: dict = field(default_factory=dict)  # loc -> likely cause
    run_causes: list = field(default_factory=list)  # likely causes for the whole run
    shown_loc: dict = field(default_factory=dict)  # recorded loc -> current file:line

    @property
    def passed(self):
        return not self.mismatches and not self.missing

    def summary(self, limit=10) -> str:
        what = (f"{self.compared - self.lines} logged values and {self.lines} printed lines"
                if self.lines else f"{self.compared} logged values")
        if self.passed:
            return f"deferred checks passed: {what} of unchanged statements equal the record's"
        lines = [f"deferred checks FAILED: of {self.compared + len(self.missing)} values the "
                 f"record logged or printed, {len(self.mismatches)} differ and "
                 f"{len(self.missing)} were not logged again:"]
        for loc, name, ctx, seq, rec, rep in self.mismatches[:limit]:
            lines.append(f"  {self._stmt(loc, name)} at {describe(ctx, seq)}: recorded "
                         f"{_show(rec)}, replayed {_show(rep)}")
        for loc, name, ctx, seq, rec in self.missing[:max(0, limit - len(self.mismatches))]:
            lines.append(f"  {self._stmt(loc, name)} at {describe(ctx, seq)}: recorded "
                         f"{_show(rec)}, not logged by the replay")
        more = len(self.mismatches) + len(self.missing) - limit
        if more > 0:
            lines.append(f"  ... and {more} more")
        shown = set()
        for loc, *_ in self.mismatches + self.missing:
            cause = self.causes.get(loc)
            if cause and cause not in shown:
                shown.add(cause)
                lines.append(f"  likely cause ({self.shown_loc.get(loc, loc)}): {cause}")
        return "\n".join(lines)

    def _stmt(self, loc, name):
        where = self.shown_loc.get(loc, loc)
        return f"{where} (printed)" if name.startswith("stdout@") else f"{where} {name!r}"


def _show(value_json):
    try:
        value = json.loads(value_json)
    except (TypeError, ValueError):
        return str(value_json)
    return repr(value) if isinstance(value, str) else json.dumps(value)


_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf")


def equal(a, b, tolerance=0.0) -> bool:
    """Recorded and replayed values (decoded JSON): exact, or numbers within
    a relative `tolerance` (numbers inside printed lines too)."""
    if tolerance <= 0:
        return a == b
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b:
            return True
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= tolerance * max(abs(a), abs(b))
    if isinstance(a, str) and isinstance(b, str):
        na, nb = _NUMBER.findall(a), _NUMBER.findall(b)
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b) or len(na) != len(nb):
            return False
        return all(equal(float(x), float(y), tolerance) for x, y in zip(na, nb))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y, tolerance) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k], tolerance) for k in a)
    return a == b


def _present(loc, files):
    rel, line, new = parse_location(loc)
    fmap = files.get(rel)
    return fmap is not None and not new and line is not None and line in fmap


def compare_logs(store, record_id, replay_id, plan=None, tolerance=0.0) -> CheckReport:
    """Compare a replay's values with its record's (`plan`: the replay's
    Plan, read from the store when not given)."""
    if plan is None:
        plan = Plan.load(store.plan_path(replay_id))
    report = CheckReport()
    recorded, seen_twice = {}, set()
    for r in store.logs(record_id):
        key = (r["loc"], r["name"], r["ctx"], r["seq"])
        if key in recorded:
            seen_twice.add(key)
        recorded[key] = r["value"]
    for key in seen_twice:  # cannot tell which value is which: not compared
        del recorded[key]
    report.ambiguous = len(seen_twice)
    replayed = {}
    for r in store.logs(replay_id):
        replayed[(r["loc"], r["name"], r["ctx"], r["seq"])] = r["value"]
    for key, value in replayed.items():
        if key in recorded:
            report.compared += 1
            report.lines += key[1].startswith("stdout@")
            if recorded[key] != value and not equal(
                    json.loads(recorded[key]), json.loads(value), tolerance):
                report.mismatches.append((*key, recorded[key], value))
    ran = {(b["block"], b["ctx"], b["occurrence"])
           for b in store.run_rows("blockruns", replay_id) if b["state"] in RAN}
    files = plan.present()
    for key, value in recorded.items():
        loc, name, ctx, seq = key
        if key in replayed or not _present(loc, files):
            continue
        if all(b in ran for b in enclosing_blocks(ctx)):
            report.missing.append((*key, value))
    return report


_BUILTINS = set(dir(builtins))
_CLOCK = re.compile(r"\btime\b|perf_counter|monotonic|datetime|elapsed|\bnow\(")


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


def explain(report, store, plan, source, rec=None):
    """Fill report.shown_loc (current file:line of each statement),
    report.causes (a likely cause per statement that differed) and
    report.run_causes (causes that concern the whole replay)."""
    back = {rel: {v: k for k, v in lines.items()} for rel, (lines, _) in plan.line_maps().items()}
    bad = {loc for loc, *_ in report.mismatches + report.missing}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    lines = source.splitlines()
    hands_free = plan.hands_free or {}
    restored = {b["block"] for b in store.run_rows("blockruns", plan.replay_id)
                if b["state"] in ("skip", "pseudoresume")}
    blocks = [b for b in hands_free.get("blocks", []) if b["key"] in restored]
    not_state = Script(tree).not_state if tree is not None else set()
    parts = store.rows("parts", plan.replay_id)
    captured = {}  # block -> what the replay captured, completion included
    for part in parts:
        for key, labels in (json.loads(part["info"] or "{}").get("captured") or {}).items():
            for label in labels:
                for name in label.split(":", 1)[0].split(", "):
                    captured.setdefault(key, set()).add(name.removeprefix("global "))
    for loc in bad:
        rel, line, new = parse_location(loc)
        cur = line if new else back.get(rel, {}).get(line) if line is not None else None
        report.shown_loc[loc] = f"{rel}:{cur}" if cur else loc
        if cur is None or tree is None or rel != os.path.basename(plan.script):
            continue
        report.causes[loc] = _statement_cause(tree, lines, cur, rel, blocks, hands_free,
                                              captured, not_state)
        if report.causes[loc] is None:
            del report.causes[loc]
    if not report.passed and rec is not None:
        rec_threads = json.loads(rec["info"] or "{}").get("threads")
        used = {json.loads(p["info"] or "{}").get("threads") for p in parts}
        if rec_threads is not None and used - {rec_threads}:
            report.run_causes.append(
                f"the record ran torch with {rec_threads} intra-op threads and the replay "
                f"with {sorted(t for t in used if t)}; CPU results match bit for bit only "
                "with the same thread count (set it in the script with torch.set_num_threads)")


def _statement_cause(tree, lines, cur, rel, blocks, hands_free, captured, not_state):
    """The likely cause of a difference in the statement at line `cur`."""
    stmt = _statement_at(tree, cur)
    text = "\n".join(lines[stmt.lineno - 1:stmt.end_lineno]) if stmt else ""
    if _CLOCK.search(text):
        return "the statement reads the clock, so its values differ between runs"
    before = [b for b in blocks if b["line"] < cur] or blocks
    if not before:
        if not hands_free:
            return None
        return ("no block was restored before it: the difference comes from outside "
                "flor's blocks (nondeterminism, the clock, other processes or files)")
    b = max(before, key=lambda b: b["line"])
    held = sorted(set(b["names"] + b["paths"] + b["globals"]) | captured.get(b["key"], set()))
    suspects = []
    for p in sorted(_paths_read(stmt)) if stmt else []:
        r = root(p)
        if r not in b["reads"] or (p == r and r in not_state):
            continue
        if any(p == h or p.startswith(h + ".") or p.startswith(h + "[") for h in held):
            continue
        if any(q != p and q.startswith(p + ".") for q in _paths_read(stmt) if root(q) == r):
            continue  # report the longest path read
        suspects.append(p)
    where = f"{rel}:{b['line']}"
    if suspects:
        return (f"the side-effect set of the block at {where} may be "
                f"missing {', '.join(f'`{x}`' for x in suspects)}")
    return (f"the side-effect set of the block at {where} (restored from a checkpoint) "
            f"may be incomplete; it holds {', '.join(held) or 'only the random state'}. "
            "State changed where flor cannot see it (another module's code, a C "
            "extension) is not captured")
