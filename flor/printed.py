"""The numbers in printed lines: what a hindsight ``print`` says, as data.

A printed statement's values are its lines (``stdout@train.py:24``, see
flor/context.py).  The numbers in them are values too:

    "epoch 3 | loss 0.2314 val acc: 0.91 lr=1e-3"
        -> fields {"epoch": 3, "loss": 0.2314, "val_acc": 0.91, "lr": 0.001}
           named stdout@train.py:24/loss ...   (`name value`, `name: value`,
                                                `name=value`, `name tensor(value)`;
                                                a name of up to three words)
    "0.2314", "grad norm tensor(0.52)"
        -> number 0.2314, 0.52                  (a line with one number: the
                                                 statement's own value)

The first value of a name in a line counts.  A word that is part of a
longer one (``w0``, ``1e-3x``) is not a number.
"""
from __future__ import annotations

import re

from .context import PRINTED

__all__ = ["fields", "number", "split", "field_name"]

_NUM = r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
_WORD = r"[A-Za-z_][\w.]*"
# A name is up to three words, one space apart ("val loss 2.31" is val_loss)
_PAIR = re.compile(rf"(?<![\w.])((?:{_WORD} ){{0,2}}?{_WORD})\s*(?:[:=]\s*|\s+)(?:tensor\()?"
                   rf"({_NUM})(?![\w.])")
_ALONE = re.compile(rf"(?<![\w.]){_NUM}(?![\w.])")
_FIELD = re.compile(r"(.*:\d+)/(.+)")


def _float(text) -> float:
    value = float(text)
    return int(value) if re.fullmatch(r"[-+]?\d+", text) else value


def fields(text: str) -> dict:
    """{name: number} of the `name value` pairs of a printed line."""
    out: dict = {}
    for name, value in _PAIR.findall(text):
        if name.lower() in ("nan", "inf"):
            continue
        out.setdefault(name.replace(" ", "_"), _float(value))
    return out


def number(text: str):
    """The line's number where it has exactly one, else None."""
    found = _ALONE.findall(text)
    if len(found) != 1:
        return None
    return _float(found[0])


def split(name: str) -> tuple[str, str | None]:
    """(printed statement's name, field) of ``stdout@file:line/field``;
    (name, None) for any other name."""
    if name.startswith(PRINTED):
        m = _FIELD.fullmatch(name)
        if m:
            return m.group(1), m.group(2)
    return name, None


def field_name(name: str, field: str) -> str:
    return f"{name}/{field}"
