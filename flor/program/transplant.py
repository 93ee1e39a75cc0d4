"""Statements added to a script, carried onto another version of it.

`flor replay --runs` applies the statements a user added to the script to
older records, whose kept sources may differ from the script the user
edited (a variable renamed, a line moved, an argument added).  What is
carried is the lines the edit added: each run of added lines goes into the
other version next to the same code it follows in the edited script (the
line above it, else the line below it, skipping blank and comment lines),
matched line for line, indentation included, in the same function (a
line its function has more than once counts only where the line on the
other side confirms it; lines that close the block above go where that
block ends; lines the version already has there are not added again).

A line of the edit that resembles the line it replaces is a changed
line, not an added one: changed and removed lines stay as the other
version has them.  Where an edit both adds lines and removes or rewrites
lines beside them, which are added cannot be told, and nothing is
carried.  Nor is a run of added lines whose neighbours are not in the
other version, nor a version where the result does not parse: the caller
skips that record and says why.
"""
from __future__ import annotations

import ast
import difflib
from typing import NamedTuple

__all__ = ["Carried", "base_of", "carry"]

SIMILAR = 0.6  # a replacing line at least this like the line it replaces may change it
CLEARLY = 0.7  # beside added lines, each changed line at least this like its line


class Carried(NamedTuple):
    """`text`: the other version with the added lines, or None where they
    cannot be carried (`why`); `lines`: how many lines were added;
    `at`: {line in text: its line in the edited script} of those lines."""

    text: str | None
    why: str | None = None
    lines: int = 0
    at: dict = {}


def _matcher(a, b):
    return difflib.SequenceMatcher(None, a, b, autojunk=False)


def _similar(x: str, y: str) -> float:
    s = _matcher(x.strip(), y.strip())
    if s.real_quick_ratio() < SIMILAR or s.quick_ratio() < SIMILAR:
        return 0.0
    r = s.ratio()
    return r if r >= SIMILAR else 0.0


def _targets(line: str):
    """What an assignment on `line` assigns (None for another statement)."""
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(node, ast.Assign):
        return [ast.dump(t) for t in node.targets]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [ast.dump(node.target)]
    return None


class Unclear(Exception):
    """Lines of an edit that may be changed lines or added ones."""


def _split_replacement(a_lines, b_lines, i1, j1):
    """Insertions among lines `b_lines` (from new line j1 + 1) that replace
    `a_lines` (from base line i1 + 1).  Lines are paired in order where they
    resemble each other, the pairs chosen for the most likeness in all
    (a changed line); a line of b left unpaired is added, after the last
    line of a paired before it.  Where a line of a is left unpaired too, or
    a pair is not clearly alike, which of b's lines are added cannot be
    told: Unclear.
    [(after base line p, lines, new line of the first)]."""
    n, m = len(a_lines), len(b_lines)
    if n * m > 40000:
        raise Unclear(f"lines {j1 + 1}-{j1 + m}")
    sim = [[_similar(x, y) for y in b_lines] for x in a_lines]
    # best[i][j]: the most likeness pairing a[i:] with b[j:] in order
    best = [[0.0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            pair = sim[i][j] + best[i + 1][j + 1] if sim[i][j] else 0.0
            best[i][j] = max(pair, best[i + 1][j], best[i][j + 1])
    paired_b, i, j, k_of = set(), 0, 0, {}
    unpaired_a, weakest = 0, 1.0
    while i < n and j < m:
        if sim[i][j] and best[i][j] == sim[i][j] + best[i + 1][j + 1]:
            paired_b.add(j)
            k_of[j] = i + 1
            weakest = min(weakest, sim[i][j])
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            unpaired_a += 1
            i += 1
        else:
            j += 1
    unpaired_a += n - i
    added = [j for j in range(m) if j not in paired_b]
    if not added:
        return []  # changed lines only
    pairs = [(k_of[j] - 1, j) for j in paired_b]
    if unpaired_a or weakest < CLEARLY or \
            any(_targets(a_lines[i]) != _targets(b_lines[j]) for i, j in pairs) or \
            any(_targets(b_lines[j]) is not None and _targets(b_lines[j]) == _targets(x)
                for j in added for x in a_lines):
        # A line removed or rewritten beside added ones, a change that is
        # only somewhat like its line or assigns another name, or an added
        # line that assigns what a replaced one did: which are added is a guess.
        raise Unclear(f"line {j1 + added[0] + 1}")
    out, k = [], 0
    for j in range(m):
        if j in paired_b:
            k = k_of[j]
            continue
        p = i1 + k
        if out and out[-1][0] == p and out[-1][2] + len(out[-1][1]) == j1 + j + 1:
            out[-1][1].append(b_lines[j])
        else:
            out.append((p, [b_lines[j]], j1 + j + 1))
    return out


def _added(base: list[str], new: list[str]):
    """Each run of lines `new` adds to `base`: (after base line p (1-based,
    0 = the start), the new lines, the new line (1-based) of the first)."""
    insertions = []
    for tag, i1, i2, j1, j2 in _matcher(base, new).get_opcodes():
        if tag == "insert":
            insertions.append((i1, new[j1:j2], j1 + 1))
        elif tag == "replace":
            insertions += _split_replacement(base[i1:i2], new[j1:j2], i1, j1)
    return insertions


def _scopes(text: str, n: int) -> list[str]:
    """The dotted function or class each of the `n` lines of `text` is in
    (index 0 unused), "" at the top level."""
    out = [""] * (n + 2)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                for line in range(first, min(child.end_lineno, n) + 1):
                    out[line] = inner
                visit(child, inner)
            else:
                visit(child, scope)
    visit(tree, "")
    return out


class _Version:
    """Another version's lines, matched against the base's."""

    def __init__(self, base: list[str], base_scopes, text: str):
        self.lines = text.splitlines()
        self.base, self.base_scopes = base, base_scopes
        self.scopes = _scopes(text, len(self.lines))
        self.same, self.taken = {}, {}  # base line <-> its line here, where the diff matched
        for tag, i1, i2, j1, _ in _matcher(base, self.lines).get_opcodes():
            if tag == "equal":
                for k in range(i2 - i1):
                    self.same[i1 + k + 1] = j1 + k + 1
                    self.taken[j1 + k + 1] = i1 + k + 1
        self.where: dict = {}  # (scope, text) -> its lines here, in order
        for i, line in enumerate(self.lines, 1):
            self.where.setdefault((self.scopes[i], line), []).append(i)
        self.functions = set(self.scopes)
        self.base_where: dict = {}
        for i, line in enumerate(base, 1):
            self.base_where.setdefault((base_scopes[i], line), []).append(i)

    def specific(self, b: int, got: int) -> bool:
        """Whether base line `b`, found at line `got` here, is the only line
        of its text in its function, in the base and here."""
        key = (self.base_scopes[b], self.base[b - 1])
        return len(self.base_where.get(key, ())) == 1 and \
            len(self.where.get((self.scopes[got], self.lines[got - 1]), ())) == 1

    def find(self, b: int) -> int | None:
        """The line of this version that is base line `b`, in the same
        function: where the diff matched it; else the same line at the same
        place among its copies in the function; else, where the version has
        no function of that name (renamed), the one line of that text in the
        version.  A line the diff matched to another base line is none of
        these.  None where there is no such line."""
        text, scope = self.base[b - 1], self.base_scopes[b]
        got = self.same.get(b)
        if got is not None and self.scopes[got] == scope:
            return got
        nth = sum(1 for i in range(1, b) if self.base[i - 1] == text
                  and self.base_scopes[i] == scope)
        here = self.where.get((scope, text), [])
        if len(here) > nth:
            got = here[nth]
        elif scope not in self.functions:
            every = [i for i, line in enumerate(self.lines, 1) if line == text]
            got = every[0] if len(every) == 1 else None
        else:
            got = None
        return got if got is not None and self.taken.get(got, b) == b else None


def _indent(lines) -> int:
    """The indentation of the first line that says something."""
    for x in lines:
        if not _quiet(x):
            return len(x) - len(x.lstrip())
    return 0


def _quiet(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")


def base_of(new: str, versions: dict) -> object:
    """The key of the version in `versions` ({key: text}, newest first) that
    the edited script `new` was edited from: the newest that `new` only adds
    lines to, else the one it differs least from (the fewest lines one has
    and the other lacks; the newest of those that tie)."""
    b = new.splitlines()
    best, score = None, None
    for key, text in versions.items():
        a = text.splitlines()
        ops = _matcher(a, b).get_opcodes()
        if all(tag in ("equal", "insert") for tag, *_ in ops):
            return key
        same = sum(i2 - i1 for tag, i1, i2, *_ in ops if tag == "equal")
        differ = len(a) + len(b) - 2 * same
        if score is None or differ < score:
            best, score = key, differ
    return best


def carry(base: str, new: str, other: str, name: str = "the script") -> Carried:
    """`other` with the lines that `new` adds to `base` (see the module's
    docstring)."""
    a, b = base.splitlines(), new.splitlines()
    try:
        insertions = _added(a, b)
    except Unclear as e:
        return Carried(None, f"{e} of {name} replace lines of the version edited so unlike them "
                       "that flor cannot tell which lines are added and which changed")
    if not insertions:
        return Carried(other)
    version = _Version(a, _scopes(base, len(a)), other)
    c = list(version.lines)
    placed = []  # (index in c to insert before, order, lines, new line of the first)
    for order, (p, lines, at) in enumerate(insertions):
        before = p  # the nearest line above that says something
        while before > 0 and _quiet(a[before - 1]):
            before -= 1
        after = p + 1
        while after <= len(a) and _quiet(a[after - 1]):
            after += 1
        up = version.find(before) if before > 0 else None
        down = version.find(after) if after <= len(a) else None
        # A line its function has more than once (`)`, `else:`, a repeated
        # step) places the lines only where the line on their other side
        # confirms it: next to it in this version too.
        adjacent = up is not None and down is not None and \
            all(_quiet(x) for x in c[up:down - 1]) and down > up
        if up is not None and not (version.specific(before, up) or adjacent):
            up = None
        if down is not None and not (version.specific(after, down) or adjacent):
            down = None
        if up is not None and down is not None and _indent(lines) < _indent([a[before - 1]]):
            up = None  # lines that close the block above go where it ends here
        if before == 0:
            where = 0 if down is None else down - 1
        elif up is not None:
            where = up
        elif down is not None:
            where = down - 1
        else:
            first = next((x.strip() for x in lines if not _quiet(x)), lines[0].strip())
            around = a[before - 1].strip()
            return Carried(None, f"the code around the statement added at line {at} of {name} "
                           f"({first}) is not in this version: line {around!r} above it is "
                           "not (or not once in the same function), nor is the line below it")
        if c[where:where + len(lines)] == lines or c[max(0, where - len(lines)):where] == lines:
            continue  # the version has them there already
        placed.append((where, order, lines, at))
    at_lines = {}
    for where, _, lines, at in sorted(placed, key=lambda x: (-x[0], -x[1])):
        c[where:where] = lines
    shift = 0
    for where, _, lines, at in sorted(placed, key=lambda x: (x[0], x[1])):
        for k in range(len(lines)):
            at_lines[where + shift + k + 1] = at + k
        shift += len(lines)
    text = "\n".join(c) + ("\n" if other.endswith("\n") or not other else "")
    try:
        ast.parse(text)
    except SyntaxError as e:
        return Carried(None, f"the statements added to {name} do not fit this version: with "
                       f"them it does not parse ({e.msg}, line {e.lineno})")
    return Carried(text, None, sum(len(lines) for _, _, lines, _ in placed), at_lines)
