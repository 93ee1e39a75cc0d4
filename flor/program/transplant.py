"""Statements added to a script, carried onto another version of it.

`flor replay --runs` applies the statements a user added to the script to
older records, whose kept sources may differ from the script the user
edited (a variable renamed, a line moved, an argument added).  What is
carried is the lines the edit added: each run of added lines goes into the
other version next to the same code it follows in the edited script (the
line above it, else the line below it, skipping blank and comment lines),
matched line for line, indentation included.  A run of added lines whose
neighbours are not in the other version is not carried, and neither is a
version where the result does not parse: the caller skips that record and
says why.  Lines the edit changed or removed (rather than added) stay as
the other version has them.
"""
from __future__ import annotations

import ast
import difflib
from typing import NamedTuple

__all__ = ["Carried", "base_of", "carry"]


class Carried(NamedTuple):
    """`text`: the other version with the added lines, or None where they
    cannot be carried (`why`); `lines`: how many lines were added."""

    text: str | None
    why: str | None = None
    lines: int = 0


def _matcher(a, b):
    return difflib.SequenceMatcher(None, a, b, autojunk=False)


def _added(base: list[str], new: list[str]):
    """(insertions, changed): each run of lines `new` adds to `base` as
    (after base line p (1-based, 0 = the start), the new lines, where they
    start in new); and the new lines (1-based) of changes other than
    additions."""
    insertions, changed = [], []
    for tag, i1, i2, j1, j2 in _matcher(base, new).get_opcodes():
        if tag == "insert":
            insertions.append((i1, new[j1:j2], j1 + 1))
        elif tag != "equal":
            changed.append(j1 + 1 if j2 > j1 else None)
    return insertions, changed


def _same_lines(base: list[str], other: list[str]) -> dict[int, int]:
    """{base line: its line in other} of the lines both have, unchanged."""
    m = {}
    for tag, i1, i2, j1, _ in _matcher(base, other).get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                m[i1 + k + 1] = j1 + k + 1
    return m


def _quiet(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")


def base_of(new: str, versions: dict) -> object:
    """The key of the version in `versions` ({key: text}) that the edited
    script `new` differs least from (the one the user edited): the first
    of those that share the most lines with it."""
    b = new.splitlines()
    best, score = None, -1
    for key, text in versions.items():
        same = sum(n for *_, n in _matcher(text.splitlines(), b).get_matching_blocks())
        if same > score:
            best, score = key, same
    return best


def carry(base: str, new: str, other: str, name: str = "the script") -> Carried:
    """`other` with the lines that `new` adds to `base` (see the module's
    docstring)."""
    a, b, c = base.splitlines(), new.splitlines(), other.splitlines()
    insertions, _ = _added(a, b)
    if not insertions:
        return Carried(other)
    same = _same_lines(a, c)
    placed = []  # (index in c to insert before, order, lines)
    for order, (p, lines, at) in enumerate(insertions):
        before = p  # the nearest line above that says something
        while before > 0 and _quiet(a[before - 1]) and before not in same:
            before -= 1
        after = p + 1
        while after <= len(a) and _quiet(a[after - 1]) and after not in same:
            after += 1
        if before == 0:
            where = 0 if after > len(a) or after not in same else same[after] - 1
        elif before in same:
            where = same[before]
        elif after <= len(a) and after in same:
            where = same[after] - 1
        else:
            first = next((x.strip() for x in lines if not _quiet(x)), lines[0].strip())
            around = a[before - 1].strip()
            return Carried(None, f"the code around the statement added at line {at} of {name} "
                           f"({first}) is not in this version: line {around!r} above it "
                           "changed here, and so did the line below it")
        placed.append((where, order, lines))
    for where, _, lines in sorted(placed, key=lambda x: (-x[0], -x[1])):
        c[where:where] = lines
    text = "\n".join(c) + ("\n" if other.endswith("\n") or not other else "")
    try:
        ast.parse(text)
    except SyntaxError as e:
        return Carried(None, f"the statements added to {name} do not fit this version: with "
                       f"them it does not parse ({e.msg}, line {e.lineno})")
    return Carried(text, None, sum(len(lines) for _, _, lines in placed))
