"""Statements of a run's kept sources: the statement at a location, and the
name of a hindsight statement's printed lines.

A line that a replay added is at ``file:new:N`` in the edited file, and N
moves whenever lines are added above it.  Its printed lines are named
after the statement instead: the function it is in and its text, with its
place among the same text in the same function as the tie-break,

    print("w0 norm", w0.norm())   in  def train(...)  of train.py
        -> stdout@train.py:train~3fa2c1d0

(``train.py:~3fa2c1d0`` at the top level of the file; a method's
function is ``Trainer.fit``).  The eight hex digits are a digest of the
function and of the statement's syntax tree, so that spacing, comments
and the lines around it do not change the name, and the same statement
added in replays of different records, or moved between two replays, has
one name.  Identical statements in one function are told apart by their
order: a copy added above one takes its name.  A statement whose text
changes (a corrected statement) gets a new name; the values of the old
one stay under the old name.  A line of the recorded file keeps its
recorded number (``stdout@train.py:57``): it does not move.  The old name of an added
line (``stdout@train.py:new:31``) still finds what that line printed
(flor/store.py).  A statement that ``replay --runs`` carried onto an
older version of the script (flor/replay/many.py) is named as it is in the
script the user edited, whatever that version calls its function.
"""
from __future__ import annotations

import ast
import hashlib

from .context import PRINTED, parse_location
from .program.syntax import bodies

__all__ = ["Sources", "innermost", "printed_names", "STABLE"]

#: The location part of a hindsight statement's name: its function (dotted,
#: maybe empty) and the digest.
STABLE = r"[\w.]*~[0-9a-f]{8}"


def innermost(tree, line: int):
    """The innermost statement of `tree` on `line`, or None."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= line <= node.end_lineno and (
                best is None or node.end_lineno - node.lineno <= best.end_lineno - best.lineno):
            best = node
    return best


def _simple_statements(tree):
    """(function's dotted name, statement) of each simple statement (one
    with no body) of `tree`, in source order."""
    out = []

    def visit(body, scope):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body, scope + (node.name,))
                continue
            nested = bodies(node)
            if not nested:
                out.append((".".join(scope), node))
            for _, sub in nested:
                visit([x for part in sub for x in (
                    part.body if isinstance(part, (ast.ExceptHandler, ast.match_case))
                    else [part])], scope)

    visit(tree.body, ())
    return out


def _shape(node) -> str:
    """A syntax tree as text, positions left out, the same on every Python
    version: a field that is empty (None, []) is left out, since versions
    differ in showing those (ast.dump does)."""
    if isinstance(node, ast.AST):
        fields = [f"{f}={_shape(v)}" for f in node._fields
                  if (v := getattr(node, f, None)) is not None and not (isinstance(v, list)
                                                                       and not v)]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_shape(x) for x in node) + "]"
    return repr(node)


def printed_names(tree, rel: str) -> dict[int, str]:
    """{line: name} of the printed lines of each simple statement of the
    parsed source `tree` (file `rel`), for every line the statement spans.
    Statements that share a line (``print(x); sys.stdout.flush()``) are
    named together: a printed line's location cannot tell them apart."""
    groups: list = []  # [scope, statements, first line, last line]
    for scope, node in _simple_statements(tree):
        if groups and groups[-1][0] == scope and node.lineno <= groups[-1][3]:
            groups[-1][1].append(node)
            groups[-1][3] = max(groups[-1][3], node.end_lineno)
        else:
            groups.append([scope, [node], node.lineno, node.end_lineno])
    seen: dict = {}
    out: dict[int, str] = {}
    for scope, nodes, first, last in groups:
        shape = "\n".join(_shape(n) for n in nodes)  # spacing and moves do not count
        nth = seen.get((scope, shape), 0)
        seen[(scope, shape)] = nth + 1
        digest = hashlib.sha1(f"{scope}\0{shape}\0{nth}".encode()).hexdigest()[:8]
        name = f"{PRINTED}{rel}:{scope}~{digest}"
        for line in range(first, last + 1):
            out[line] = name
    return out


class Sources:
    """The kept sources of a store's runs, each file read and parsed once:
    a statement's text at a location, and the names of a replay's printed
    lines."""

    def __init__(self, store):
        self.store = store
        self._files: dict = {}  # (run id, rel) -> (text, tree), None where not kept
        self._names: dict = {}  # (run id, rel) -> printed_names

    def _file(self, run, rel: str, new: bool):
        """(text, tree) of file `rel` as run `run` (a run row) had it: a line
        that a replay added is read from the replay's sources, a recorded
        one from the record's."""
        source_run = run["run_id"] if new or run["kind"] == "record" else (run["parent"] or
                                                                           run["run_id"])
        key = (source_run, rel)
        if key not in self._files:
            sources = self.store.layout.module_sources(source_run)
            owner = self.store.run(source_run) or run
            text = sources.get(None) if rel == (owner["script_name"] or "") else sources.get(rel)
            tree = None
            if text is not None:
                try:
                    tree = ast.parse(text)
                except SyntaxError:
                    pass
            self._files[key] = (text, tree)
        return self._files[key]

    def statement(self, run, loc) -> str | None:
        """The text of the statement at location `loc` of run `run`."""
        if not loc:
            return None
        rel, line, new = parse_location(loc)
        if line is None:
            return None
        text, tree = self._file(run, rel, new)
        if text is None:
            return None
        best = innermost(tree, line) if tree is not None else None
        if best is not None and not hasattr(best, "body"):  # a simple statement
            segment = ast.get_source_segment(text, best)
            if segment:
                return segment
        lines = text.splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else None

    def namer(self, run):
        """The name of the lines printed at a location of run `run` (a run
        row): a replay's added line by its statement (printed_names), any
        other by its location."""
        def name(loc: str) -> str:
            rel, line, new = parse_location(loc)
            if new and line is not None:
                key = (run["run_id"], rel)
                if key not in self._names:
                    _, tree = self._file(run, rel, True)
                    self._names[key] = printed_names(tree, rel) if tree is not None else {}
                    # Lines replay --runs carried: named as in the script edited.
                    carried = self.store.layout.printed_names(run["run_id"]).get(rel, {})
                    self._names[key].update(carried)
                found = self._names[key].get(line)
                if found is not None:
                    return found
            return PRINTED + loc
        return name
