"""Output capture (csrc/capture.c, flor/runtime/capture.py) and the printed
lines the store reads back from it (flor/context.py printed_lines)."""
import io
import json

import pytest

from flor import _core
from flor.context import printed_lines

pytestmark = pytest.mark.unit  # in-process: `make check` runs these


def _journal(user=True):
    j = _core.Journal(lambda code: user)
    j.info = ("info",)
    return j


class _Stream:
    def __init__(self, tee):
        self.write = tee.write


def test_writes_of_one_statement_in_one_context_make_one_segment():
    j, real = _journal(), io.StringIO()
    out = _Stream(_core.Tee(j, real, 0, True))
    assert out.write("") == 0
    for i in range(3):
        print(f"line {i}", file=out)  # two writes: the text, then the newline
    print("x", file=out)  # another statement
    j.info = ("next",)
    for _ in range(1):
        print("y", file=out)
    segs = j.take()
    assert real.getvalue() == "line 0\nline 1\nline 2\nx\ny\n"
    assert [s[5] for s in segs] == ["line 0\nline 1\nline 2\n", "x\n", "y\n"]
    assert [s[0] for s in segs] == [1, 2, 3] and j.ord == 3
    assert segs[0][2] is segs[1][2] is test_writes_of_one_statement_in_one_context_make_one_segment.__code__
    assert segs[0][3] != segs[1][3]  # the instruction offsets of two statements
    assert [s[4] for s in segs] == [("info",), ("info",), ("next",)]
    assert j.take() == []


def test_what_is_not_journaled():
    j, real = _journal(user=False), io.StringIO()
    out, err = _core.Tee(j, real, 0, False).write, _core.Tee(j, real, 1, True).write
    out("not the user's\n")
    err("to stderr\n")
    j.capturing = False
    out("discarded\n")
    err("")
    segs = j.take()
    assert real.getvalue() == "to stderr\n"  # stdout does not tee
    assert [(s[1], s[2], s[5]) for s in segs] == [(0, None, "not the user's\n"),
                                                  (1, None, "to stderr\n")]
    with pytest.raises(TypeError, match="must be str, not bytes"):
        out(b"x")


def test_writes_another_statement_made_are_journaled_without_a_statement():
    j = _journal()
    j.add(0, "replayed\n", False)
    j.add(0, "", False)
    (seg,) = j.take()
    assert seg[2] is None and seg[5] == "replayed\n"


def _row(ord_, text, loc="s.py:3", ctx="[]", stream="stdout"):
    return {"run_id": "r", "part": 0, "ord": ord_, "phase": None, "top": None, "stream": stream,
            "ctx": ctx, "loc": loc, "text": text}


def test_printed_lines_are_values_of_their_statement():
    rows = [_row(1, "a\nb\n"), _row(2, "c", loc="s.py:4"), _row(3, "d\n", loc="s.py:4"),
            _row(4, "e", loc="s.py:5"), _row(5, "ignored\n", loc=None),
            _row(6, "f\n", ctx='[["L","s.py:1",0,2]]'), _row(7, "on stderr\n", stream="stderr")]
    got = [(r["name"], json.loads(r["value"]), r["seq"], r["iter"]) for r in printed_lines(rows)]
    assert got == [("stdout@s.py:3", "a", 0, "[]"), ("stdout@s.py:3", "b", 1, "[]"),
                   ("stdout@s.py:4", "cd", 0, "[]"),  # one line written in two segments
                   ("stdout@s.py:5", "e", 0, "[]"),  # left unended, then other output
                   ("stdout@s.py:3", "f", 0, "[2]")]


def test_an_unended_line_ends_when_the_context_changes():
    rows = [_row(1, "x", ctx='[["L","s.py:1",0,0]]'), _row(2, "y\n", ctx='[["L","s.py:1",0,1]]')]
    assert [json.loads(r["value"]) for r in printed_lines(rows)] == ["x", "y"]
