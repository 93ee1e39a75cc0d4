"""The numbers in printed lines: what a hindsight ``print`` says, as data.

A printed statement's values are its lines (``stdout@train.py:24``, see
flor/context.py).  The numbers in them are values too:

    "epoch 3 | train loss 0.2314 val/acc: 0.91 lr=1e-3 {'grad_norm': 0.5}"
        -> fields {"epoch": 3, "train_loss": 0.2314, "val/acc": 0.91, "lr": 0.001,
                   "grad_norm": 0.5}, named stdout@train.py:24/train_loss ...
    "0.2314", "tensor(0.52)"
        -> the line's one number, where it names none: the statement's own
           value (to plot and export)

A field is `name value`, `name: value`, `name=value`, `'name': value` or
`name tensor(value)`; a name is one or two words (`train loss` is
`train_loss`; a filler word such as "is" or "of" is no part of one) of
letters, digits, `_`, `/`, `@` and inner dots (`Acc@1`, `ms/batch`,
`model.lr`).  A number is an int, a float (`1e-3`, `1,234.5`), `nan` or
`inf`; not a part of a longer word (`w0`, `ckpt_10`), of a time or a date
(`12:03:44`, `2024-01-02`), a fraction (`9833/10000`) or a string
(`device='cuda:0'`).  The first value of a name in a line counts.
"""
from __future__ import annotations

import re

from .context import PRINTED
from .statements import STABLE

__all__ = ["fields", "number", "split", "field_name"]

_NUM = (r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
        r"|(?i:nan|inf(?:inity)?))")
_BEFORE = r"(?<![\w.'\"/:-])"  # not inside a word, a string, a time, a date or a fraction
_AFTER = r"(?![\w'\"]|\.\d|[:/-]\d)"
_WORD = r"[A-Za-z_][\w/@]*(?:\.[\w/@]+)*"
_PAIR = re.compile(rf"(?<![\w./@])['\"]?((?:{_WORD} )?{_WORD})['\"]?\s*(?:[:=]\s*|\s+)"
                   rf"(?:tensor\(\[?)?{_BEFORE}({_NUM}){_AFTER}")
_ALONE = re.compile(rf"{_BEFORE}{_NUM}{_AFTER}")
# What a tensor's repr adds after its value (device='cuda:0', grad_fn=<...>)
_TENSOR_EXTRA = re.compile(r",\s*(?:device|dtype|grad_fn|requires_grad)=[^,)]*")
_FILLER = {"a", "an", "the", "is", "was", "are", "were", "of", "in", "on", "at", "to", "for",
           "with", "after", "using", "so", "far", "and", "or", "by", "from", "done"}
_FIELD = re.compile(rf"(.*?:(?:\d+|{STABLE}))/(.+)")
_BIG = 2**63


def _value(text):
    """The number `text` says: an int where it has no point or exponent."""
    plain = text.replace(",", "")
    if re.fullmatch(r"[-+]?\d+", plain):
        value = int(plain)
        return value if abs(value) < _BIG else None  # an id, a seed: no metric
    return float(plain)


def _name(words: str) -> str | None:
    parts = [w for w in words.split(" ") if w.lower() not in _FILLER]
    return "_".join(parts) if parts else None


def fields(text: str) -> dict:
    """{name: number} of the named numbers of a printed line."""
    out: dict = {}
    for words, number in _PAIR.findall(_TENSOR_EXTRA.sub("", text)):
        name, value = _name(words), _value(number)
        if name is None or value is None or name.lower() in ("nan", "inf", "infinity"):
            continue
        out.setdefault(name, value)
    return out


def number(text: str):
    """The line's number where it has exactly one, else None."""
    found = _ALONE.findall(_TENSOR_EXTRA.sub("", text))
    return _value(found[0]) if len(found) == 1 else None


def unnamed(text: str):
    """The line's one number where the line names none (a statement's own
    value), else None."""
    return None if fields(text) else number(text)


def split(name: str) -> tuple[str, str | None]:
    """(printed statement's name, field) of ``stdout@file:line/field`` (or
    of an added statement's ``stdout@file:function~digest/field``,
    flor/statements.py); (name, None) for any other name."""
    if name.startswith(PRINTED):
        m = _FIELD.fullmatch(name)
        if m:
            return m.group(1), m.group(2)
    return name, None


def field_name(name: str, field: str) -> str:
    return f"{name}/{field}"
