"""What changed between the recorded script and the one being replayed.

A SkipBlock is the body of ``if flor.SkipBlock.step_into(...):`` together
with the ``flor.SkipBlock.end(...)`` call that follows it.  Replay steps into
a block whose body or end() call differs from the recorded one (or that says
``probed=True``) and skips every other block.

Blocks and loops without a name are identified by the line of their call in
the *recorded* source; lines of the current source are mapped back to it, so
adding a statement above a block does not change the block's identity.
"""
from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

__all__ = ["BlockSite", "Comparison", "compare", "find_blocks", "line_map"]


@dataclass
class BlockSite:
    name: str | None
    line: int  # line of the step_into call
    forced: bool  # probed=True in the source
    body: list[str]  # ast.dump of each body statement
    end: str | None  # ast.dump of the end() statement, if found


@dataclass
class Comparison:
    probed: set[str] = field(default_factory=set)  # block keys to step into
    changed_end: set[str] = field(default_factory=set)  # blocks whose end() changed
    added: set[str] = field(default_factory=set)  # blocks new in the current source
    lines: dict[int, int] = field(default_factory=dict)  # current line -> recorded line


def _is_call_to(node, attr):
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and (
            (isinstance(node.func.value, ast.Name) and node.func.value.id == "SkipBlock")
            or (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "SkipBlock")
        )
    )


def _contains_call(stmt, attr):
    return any(_is_call_to(n, attr) for n in ast.walk(stmt))


def _literal(call, pos, kw):
    if len(call.args) > pos and isinstance(call.args[pos], ast.Constant):
        return call.args[pos].value
    for k in call.keywords:
        if k.arg == kw and isinstance(k.value, ast.Constant):
            return k.value.value
    return None


def find_blocks(source: str) -> list[BlockSite]:
    tree = ast.parse(source)
    sites = []
    for parent in ast.walk(tree):
        for fieldname in ("body", "orelse", "finalbody"):
            stmts = getattr(parent, fieldname, None)
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                if not (isinstance(stmt, ast.If) and _is_call_to(stmt.test, "step_into")):
                    continue
                call = stmt.test
                end = next((ast.dump(s) for s in stmts[i + 1:] if _contains_call(s, "end")), None)
                sites.append(BlockSite(
                    name=_literal(call, 0, "name"),
                    line=call.lineno,
                    forced=_literal(call, 1, "probed") is True,
                    body=[ast.dump(s) for s in stmt.body],
                    end=end,
                ))
    return sites


def line_map(old: str, new: str) -> dict[int, int]:
    """Map each line of `new` that is unchanged from `old` to its line there."""
    a, b = old.splitlines(), new.splitlines()
    m = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                m[j1 + k + 1] = i1 + k + 1
    return m


def block_key(filename: str, name: str | None, line: int) -> str:
    return name if name else f"{filename}:{line}"


def compare(old: str, new: str, filename: str) -> Comparison:
    """Compare recorded source `old` with current source `new` of `filename`."""
    cmp = Comparison(lines=line_map(old, new))
    recorded = {block_key(filename, s.name, s.line): s for s in find_blocks(old)}
    for site in find_blocks(new):
        line = cmp.lines.get(site.line)
        if site.name is None and line is None:
            cmp.added.add(f"{filename}:new:{site.line}")
            continue
        key = block_key(filename, site.name, line if site.name is None else site.line)
        before = recorded.get(key)
        if before is None:
            cmp.added.add(key)
            continue
        if site.forced or site.body != before.body:
            cmp.probed.add(key)
        if site.end != before.end:
            cmp.changed_end.add(key)
            cmp.probed.add(key)
    return cmp
