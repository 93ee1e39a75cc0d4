"""What changed between the recorded program and the one being replayed.

Each file of the program that record kept (the script, and the modules of
the user's own that called flor or printed) is compared with its current
version:

- `map_files`: each current line that is unchanged maps to its recorded
  line, and each call of flor.generator and SkipBlock.step_into also maps by
  the order of such calls in the file, so that editing the line of such a
  call (adding a comment) keeps its identity;
- `changed_functions`: the functions whose definition changed, and every
  function that calls one of them, directly or not;
- `manual_blocks` (the manual API): a SkipBlock is the body of ``if
  flor.SkipBlock.step_into(...):`` with the ``flor.SkipBlock.end(...)`` call
  that follows it.  Replay steps into a block when its body changed, when
  its end() call changed, when it says ``probed=True``, or when its body
  calls a changed function.  Every other block is skipped.

Unnamed blocks and loops are identified by the location of their call in
the *recorded* file (flor/context.py).
"""
from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

from ..context import location
from .syntax import (bodies, call_graph, called_names, callers_closure, functions, reaches,
                     simple_name)

__all__ = ["BlockSite", "FileMap", "Comparison", "map_files", "changed_functions",
           "passed_as_values",
           "manual_blocks", "find_blocks", "line_map", "is_flor_call", "literal_arg"]


@dataclass
class BlockSite:
    name: str | None
    line: int  # line of the step_into call
    forced: bool  # probed=True in the source
    body: list[str]  # ast.dump of each body statement
    end: str | None  # ast.dump of the end() statement, if found
    calls: set[str]  # simple names of everything its body calls


@dataclass
class FileMap:
    """How one file of the program maps from the edited source to the recorded."""

    lines: dict[int, int] = field(default_factory=dict)  # current line -> recorded line
    sites: dict[int, int] = field(default_factory=dict)  # current call line -> recorded one
    present: set[int] = field(default_factory=set)  # recorded lines still in the file

    def to_json(self) -> dict:
        return {"lines": {str(k): v for k, v in self.lines.items()},
                "sites": {str(k): v for k, v in self.sites.items()},
                "present": sorted(self.present)}

    @classmethod
    def from_json(cls, data) -> "FileMap":
        return cls({int(k): v for k, v in data["lines"].items()},
                   {int(k): v for k, v in data["sites"].items()}, set(data["present"]))


@dataclass
class Comparison:
    """What replay decided from comparing the programs."""

    files: dict[str, FileMap] = field(default_factory=dict)
    changed_functions: set[str] = field(default_factory=set)  # and their callers
    probed: set[str] = field(default_factory=set)  # block keys to step into
    changed_end: set[str] = field(default_factory=set)  # blocks whose end() changed
    added: set[str] = field(default_factory=set)  # blocks new in the current source
    # changed functions that a library's training epoch may run (not only
    # its epoch-end hooks: flor/program/frameworks.py)
    training_changed: set[str] = field(default_factory=set)


def is_flor_call(node, attr):
    """Whether `node` calls flor.`attr` (SkipBlock.`attr` for step_into, end)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == attr):
        return False
    owner = node.func.value
    if attr in ("step_into", "end"):
        return (isinstance(owner, ast.Name) and owner.id == "SkipBlock") or \
            (isinstance(owner, ast.Attribute) and owner.attr == "SkipBlock")
    return isinstance(owner, ast.Name) and owner.id == "flor"


def literal_arg(call, pos, kw):
    """The constant given to `call` at position `pos` or as keyword `kw`, or None."""
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
        for _, stmts in bodies(parent):
            for i, stmt in enumerate(stmts):
                if not (isinstance(stmt, ast.If) and is_flor_call(stmt.test, "step_into")):
                    continue
                call = stmt.test
                end = next((ast.dump(s) for s in stmts[i + 1:]
                            if any(is_flor_call(n, "end") for n in ast.walk(s))), None)
                sites.append(BlockSite(
                    name=literal_arg(call, 0, "name"), line=call.lineno,
                    forced=literal_arg(call, 1, "probed") is True,
                    body=[ast.dump(s) for s in stmt.body], end=end, calls=called_names(stmt.body)))
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


def _call_sites(tree):
    """(kind, enclosing function, literal name) and line of each loop and block call."""
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{func}.{child.name}"
            if isinstance(child, ast.Call):
                for kind, pos, kw in (("generator", 1, "name"), ("step_into", 0, "name")):
                    if is_flor_call(child, kind):
                        out.append(((kind, func, literal_arg(child, pos, kw)), child.lineno))
            visit(child, inner)
    visit(tree, "")
    return out


def site_map(old_tree, new_tree) -> dict[int, int]:
    a, b = _call_sites(old_tree), _call_sites(new_tree)
    m = {}
    sm = difflib.SequenceMatcher(None, [t for t, _ in a], [t for t, _ in b], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                m[b[j1 + k][1]] = a[i1 + k][1]
    return m


def _pairs(old: dict[str, str], new: dict[str, str]):
    """(relpath, recorded text, current text) of each file still present."""
    return [(rel, text, new[rel]) for rel, text in old.items() if rel in new]


def map_files(old: dict[str, str], new: dict[str, str]) -> dict[str, FileMap]:
    """Line and call-site maps of each recorded file ({relpath: text}) that
    is still present."""
    files = {}
    for rel, text, cur in _pairs(old, new):
        lines = line_map(text, cur)
        files[rel] = FileMap(lines=lines, sites=site_map(ast.parse(text), ast.parse(cur)),
                             present=set(lines.values()))
    return files


def _changes(old: dict[str, str], new: dict[str, str]) -> tuple[set[str], dict, set[str]]:
    """(the functions whose definition changed, what each function calls,
    the methods), keyed ``file:qualname`` over the current files
    (syntax.call_graph)."""
    changed, trees = set(), {}
    for rel, text, cur in _pairs(old, new):
        before = {k: ast.dump(v) for k, v in functions(ast.parse(text)).items()}
        trees[rel] = ast.parse(cur)
        for qual, node in functions(trees[rel]).items():
            if before.get(qual) != ast.dump(node):
                changed.add(f"{rel}:{qual}")
    calls, meths = call_graph(trees)
    return changed, calls, meths


def changed_functions(old: dict[str, str], new: dict[str, str]) -> set[str]:
    """Simple names of the functions whose definition changed, and of every
    function that calls one of them."""
    changed, calls, meths = _changes(old, new)
    return {simple_name(k) for k in callers_closure(changed, calls, meths)}


def passed_as_values(new: dict[str, str], names) -> set[str]:
    """Those of the functions `names` that a file of `new` refers to other
    than by calling them by name (``callbacks=[report]``,
    ``trainer.set_callback("on_batch_end", report)``): code that calls
    whatever it is handed (``for cb in self.callbacks: cb(self)``) may run
    them, which no call graph by names shows."""
    out = set()
    for text in new.values():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        out |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names
                and isinstance(n.ctx, ast.Load) and id(n) not in called}
        out |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and n.attr in names and isinstance(n.ctx, ast.Load) and id(n) not in called}
    return out


def changed_outside(old: dict[str, str], new: dict[str, str], hooks) -> set[str]:
    """The changed functions that may run other than through the functions
    named in `hooks` (a library's hooks, which it calls at known points):
    those not in `hooks` that a function other than these, or nothing in
    the program, calls.  A new helper that only a hook calls is not one."""
    changed, calls, meths = _changes(old, new)
    only_hooks = {k for k in calls if simple_name(k) in hooks}  # called only from these
    grew = True
    while grew:
        grew = False
        for key in set(calls) - only_hooks:
            callers = {f for f, called in calls.items() if f != key and reaches(called, key, meths)}
            if callers and callers <= only_hooks:
                only_hooks.add(key)
                grew = True
    return {simple_name(k) for k in changed - only_hooks}


def manual_blocks(old: dict[str, str], new: dict[str, str], files: dict[str, FileMap],
                  affected: set[str]) -> tuple[set, set, set]:
    """(probed, changed_end, added) block keys of the manual API's blocks."""
    probed, changed_end, added = set(), set(), set()
    for rel, text, cur in _pairs(old, new):
        fmap = files[rel]
        recorded = {s.name or location(rel, s.line): s for s in find_blocks(text)}
        for site in find_blocks(cur):
            line = fmap.sites.get(site.line, fmap.lines.get(site.line))
            if site.name is None and line is None:
                added.add(location(rel, site.line, None, mapped=True))
                continue
            key = site.name or location(rel, line)
            before = recorded.get(key)
            if before is None:
                added.add(key)
                continue
            if site.forced or site.body != before.body or site.calls & affected:
                probed.add(key)
            if site.end != before.end:
                changed_end.add(key)
                probed.add(key)
    return probed, changed_end, added
