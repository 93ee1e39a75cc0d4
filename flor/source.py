"""What changed between the recorded program and the one being replayed.

A SkipBlock is the body of ``if flor.SkipBlock.step_into(...):`` together
with the ``flor.SkipBlock.end(...)`` call that follows it.  Replay steps into
a block when its body changed, when its end() call changed, when it says
``probed=True``, or when its body calls (directly or through other
functions) a function of the program whose definition changed.  Every other
block is skipped.

Each file of the program that holds flor calls is compared (the script, and
the modules of the user's own that record saw calling flor).  Unnamed blocks
and loops are identified by the line of their call in the *recorded* file;
current lines map back to recorded ones by text, and the calls of
flor.generator and SkipBlock.step_into also by their order in the file, so
that editing the line of such a call (adding a comment) keeps its identity.
"""
from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

__all__ = ["BlockSite", "FileMap", "Comparison", "compare_program", "find_blocks", "line_map"]


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
    lines: dict[int, int] = field(default_factory=dict)  # current line -> recorded line
    sites: dict[int, int] = field(default_factory=dict)  # current call line -> recorded one
    present: set[int] = field(default_factory=set)  # recorded lines still in the file


@dataclass
class Comparison:
    probed: set[str] = field(default_factory=set)  # block keys to step into
    changed_end: set[str] = field(default_factory=set)  # blocks whose end() changed
    added: set[str] = field(default_factory=set)  # blocks new in the current source
    changed_functions: set[str] = field(default_factory=set)
    files: dict[str, FileMap] = field(default_factory=dict)


def _is_flor_call(node, attr):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == attr):
        return False
    owner = node.func.value
    if attr in ("step_into", "end"):
        return (isinstance(owner, ast.Name) and owner.id == "SkipBlock") or \
            (isinstance(owner, ast.Attribute) and owner.attr == "SkipBlock")
    return isinstance(owner, ast.Name) and owner.id == "flor"


def _literal(call, pos, kw):
    if len(call.args) > pos and isinstance(call.args[pos], ast.Constant):
        return call.args[pos].value
    for k in call.keywords:
        if k.arg == kw and isinstance(k.value, ast.Constant):
            return k.value.value
    return None


def called_names(nodes) -> set[str]:
    """Simple names of everything `nodes` call: f() gives f, a.b.m() gives m."""
    names = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                if isinstance(n.func, ast.Name):
                    names.add(n.func.id)
                elif isinstance(n.func, ast.Attribute):
                    names.add(n.func.attr)
    return names


def find_blocks(source: str) -> list[BlockSite]:
    tree = ast.parse(source)
    sites = []
    for parent in ast.walk(tree):
        for fieldname in ("body", "orelse", "finalbody"):
            stmts = getattr(parent, fieldname, None)
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                if not (isinstance(stmt, ast.If) and _is_flor_call(stmt.test, "step_into")):
                    continue
                call = stmt.test
                end = next((ast.dump(s) for s in stmts[i + 1:]
                            if any(_is_flor_call(n, "end") for n in ast.walk(s))), None)
                sites.append(BlockSite(
                    name=_literal(call, 0, "name"), line=call.lineno,
                    forced=_literal(call, 1, "probed") is True,
                    body=[ast.dump(s) for s in stmt.body], end=end, calls=called_names(stmt.body)))
    return sites


def _functions(tree) -> dict[str, ast.AST]:
    """Functions and methods by qualified name (Class.method)."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:  # a function defined inside if, try, with, ...
                visit(child, prefix)
    visit(tree, "")
    return out


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
                    if _is_flor_call(child, kind):
                        out.append(((kind, func, _literal(child, pos, kw)), child.lineno))
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


def block_key(relpath: str, name: str | None, line: int) -> str:
    return name if name else f"{relpath}:{line}"


def compare_program(old: dict[str, str], new: dict[str, str]) -> Comparison:
    """Compare recorded sources with current ones, both {relpath: text}."""
    cmp = Comparison()
    trees = {}
    for rel, text in old.items():
        cur = new.get(rel)
        if cur is None:
            continue
        old_tree, new_tree = ast.parse(text), ast.parse(cur)
        trees[rel] = (text, cur, old_tree, new_tree)
        lines = line_map(text, cur)
        cmp.files[rel] = FileMap(lines=lines, sites=site_map(old_tree, new_tree),
                                 present=set(lines.values()))
    # Functions whose definition changed, then everything that calls them.
    changed, calls = set(), {}
    for rel, (_, _, old_tree, new_tree) in trees.items():
        before = {k: ast.dump(v) for k, v in _functions(old_tree).items()}
        for qual, node in _functions(new_tree).items():
            simple = qual.rsplit(".", 1)[-1]
            calls.setdefault(simple, set()).update(called_names(node.body))
            if before.get(qual) != ast.dump(node):
                changed.add(simple)
    affected = set(changed)
    grew = True
    while grew:
        grew = False
        for name, called in calls.items():
            if name not in affected and called & affected:
                affected.add(name)
                grew = True
    cmp.changed_functions = affected
    for rel, (text, cur, _, _) in trees.items():
        fmap = cmp.files[rel]
        recorded = {block_key(rel, s.name, s.line): s for s in find_blocks(text)}
        for site in find_blocks(cur):
            line = fmap.sites.get(site.line, fmap.lines.get(site.line))
            if site.name is None and line is None:
                cmp.added.add(f"{rel}:new:{site.line}")
                continue
            key = block_key(rel, site.name, line if site.name is None else site.line)
            before = recorded.get(key)
            if before is None:
                cmp.added.add(key)
                continue
            if site.forced or site.body != before.body or site.calls & affected:
                cmp.probed.add(key)
            if site.end != before.end:
                cmp.changed_end.add(key)
                cmp.probed.add(key)
    return cmp
