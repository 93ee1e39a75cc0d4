"""A run's configuration: what the script parsed from its command line (or
built as a config object), defaults included, as its main loop began.

    def capture(frame):                   # the first main-loop iteration's caller
        for f in frame and the frames that called it, innermost first, and then
                __main__'s globals, each only where it is the user's code (not
                flor's: its CLI's options are not the script's; not the standard
                library's or an installed package's: Lightning's loops keep
                dataclasses of counters):
            for name, value in f's variables, and the attributes of its `self`:
                argparse's or jsonargparse's Namespace, an OmegaConf DictConfig
                (as Hydra hands one over), a dataclass of scalars -> a candidate
        primary = the one namespace the command line's words agree with best
                  (or whose keys a parser in those frames defines); a tie: none
        primary's keys bare, every other candidate's under its name
        ("pre_args.lr"), nested values dotted ("model.n_embd")

The command line's words say only what the user typed: a run made with
the defaults had no value for them.  Nothing is patched: the objects are
read where the script keeps them, once.  A value that is not a number, a
string, a bool, None or a short list of them is kept as a short repr; a
value whose key names a secret (a token, a password) is kept as "***".
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import reprlib
import sys
import sysconfig
from typing import NamedTuple

__all__ = ["Config", "capture", "flatten"]

_FLOR = os.path.dirname(os.path.abspath(__file__)) + os.sep
MAX_KEYS = 500  # a configuration is cut there
MAX_ITEMS = 64  # a longer list, or a dict with more entries, is kept as a short repr
MAX_TEXT = 200
MAX_DEPTH = 4
_SCALARS = (bool, int, float, str, type(None))
_SECRET = re.compile(r"token|secret|passw|api_?key|credential", re.I)
_CO_OPTIMIZED = 0x1
_OVERRIDE = re.compile(r"\+{0,2}([A-Za-z_][\w.]*)=(.*)", re.S)
_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxdict = 8
_SHORT.maxstring = _SHORT.maxother = MAX_TEXT


class Config(NamedTuple):
    values: dict  # {key: value}
    parsed: bool  # whether they hold the command line's parse (a namespace was found)


class _Candidate(NamedTuple):
    name: str
    obj: object


def capture(frame) -> Config | None:
    """The script's configuration, from `frame` outward (see the module's
    docstring), or None where the script keeps none flor recognises."""
    found, parsers = _candidates(frame)
    if not found:
        return None
    spaces = [c for c in found if _is_namespace(c.obj)]
    primary = _primary(spaces, parsers) if spaces else (found[0] if len(found) == 1 else None)
    values: dict = {}
    for c in found:
        prefix = "" if c is primary else c.name + "."
        for key, v in flatten(c.obj, prefix).items():
            if len(values) >= MAX_KEYS:
                break
            values.setdefault(key, v)
    return Config(values, parsed=primary is not None and primary in spaces)


def _candidates(frame) -> tuple[list, list]:
    """([(name, config object)], [the argparse parsers]) of the user's frames."""
    import argparse

    found, parsers, seen = [], [], set()

    def visit(name, value):
        if id(value) in seen:
            return
        if isinstance(value, argparse.ArgumentParser):
            seen.add(id(value))
            parsers.append(value)
        elif _is_config(value):
            seen.add(id(value))
            found.append(_Candidate(name, value))

    f = frame
    while f is not None:
        if _users(f.f_code.co_filename):
            for name, value in _variables(f):
                visit(name, value)
                if name == "self":  # a class-based trainer's self.args, self.cfg
                    for attr, v in _attributes(value):
                        visit(f"self.{attr}", v)
        f = f.f_back
    main = sys.modules.get("__main__")
    if main is not None and _users(getattr(main, "__file__", None) or "<main>"):
        for name, value in list(vars(main).items()):
            visit(name, value)
    return found, parsers


def _variables(f) -> list:
    """The variables of the running frame `f`.  Reading f_locals leaves a
    snapshot of a function's variables on its frame (before Python 3.13),
    which would keep what the script deletes alive as long as the function
    runs: the snapshot is emptied again where nothing else holds it (the
    script's own locals() would; a tracer makes it again before it reads)."""
    scope = f.f_locals
    items = list(scope.items())
    if (sys.version_info < (3, 13) and type(scope) is dict and f.f_code.co_flags & _CO_OPTIMIZED
            and scope is not f.f_globals and sys.getrefcount(scope) == 3):
        scope.clear()  # held by the frame, `scope` and getrefcount's argument only
    return items


def _attributes(obj) -> list:
    try:
        attrs = vars(obj)
    except TypeError:  # no __dict__
        return []
    return [(k, v) for k, v in list(attrs.items()) if not str(k).startswith("_")][:MAX_ITEMS]


def _primary(spaces, parsers):
    """The namespace the command line was parsed into: the one whose values
    the words of sys.argv agree with most, or whose keys a parser defines;
    None where several tie (their keys are then all named by variable)."""
    typed = _typed(sys.argv[1:])
    dests = [{a.dest for a in p._actions if a.dest != "help"} for p in parsers]

    def score(c):
        items = flatten(c.obj)
        agree = sum(1 for k, text in typed.items() if k in items and _same(items[k], text))
        return agree, any(set(items) == d for d in dests)

    scores = [score(c) for c in spaces]
    best = max(scores)
    if len(spaces) > 1 and (scores.count(best) > 1 or best == (0, False)):
        return None
    return spaces[scores.index(best)]


def _typed(words) -> dict:
    """{dest: the text typed} of `--name value` and `--name=value` words, and
    Hydra's overrides (`optim.lr=0.01`, `+name=value`)."""
    out = {}
    for i, word in enumerate(words):
        hydra = _OVERRIDE.match(word)
        if hydra:
            out[hydra.group(1)] = hydra.group(2)
            continue
        if not word.startswith("--") or word == "--":
            continue
        key, eq, text = word[2:].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
            text = words[i + 1]
        out[key.replace("-", "_")] = text
    return out


def _same(value, text) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value) == text or isinstance(value, bool)
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return str(value) == text


def _libraries() -> tuple:
    """Where installed code lives: flor, the standard library, site-packages."""
    paths = sysconfig.get_paths()
    dirs = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if k in paths}
    return (_FLOR, *(d + os.sep for d in dirs))


def _users(filename: str) -> bool:
    """Whether code of `filename` is the user's (the script's, its project's)."""
    if filename.startswith("<"):  # python -c, a notebook's cell; not importlib's
        return not filename.startswith("<frozen")
    return not os.path.abspath(filename).startswith(_libraries())


def _is_namespace(value) -> bool:
    """What a command line is parsed into: argparse's Namespace (jsonargparse's
    is one), an OmegaConf DictConfig (Hydra's)."""
    import argparse

    if isinstance(value, argparse.Namespace):
        return True
    mod = type(value).__module__ or ""
    return mod.startswith("omegaconf") and type(value).__name__ == "DictConfig"


def _is_config(value) -> bool:
    return _is_namespace(value) or (dataclasses.is_dataclass(value)
                                    and not isinstance(value, type) and _scalar_fields(value, 0))


def _scalar_fields(value, depth) -> bool:
    """A dataclass whose fields are scalars, short containers of them or
    such dataclasses: a config, not a model's output or a batch of tensors."""
    if depth > MAX_DEPTH:
        return False
    for f in dataclasses.fields(value):
        v = getattr(value, f.name, None)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            if not _scalar_fields(v, depth + 1):
                return False
        elif isinstance(v, (list, tuple, dict)):
            items = v.values() if isinstance(v, dict) else v
            if not all(isinstance(x, _SCALARS) for x in items):
                return False
        elif not isinstance(v, _SCALARS) and not _plain(v):
            return False
    return True


def _plain(v) -> bool:
    """A value a config holds that is kept as text: a path, an enum member."""
    return isinstance(v, _plain_types())


def flatten(config, prefix="", depth=0) -> dict:
    """{dotted key: value} of a config object (see `capture`)."""
    out = {}
    for key, value in _items(config):
        name = f"{prefix}{key}"
        nested = _is_config(value) or (isinstance(value, dict) and len(value) <= MAX_ITEMS)
        if depth < MAX_DEPTH and nested:
            out.update(flatten(value, name + ".", depth + 1))
        else:
            out[name] = _value(name, value)
        if len(out) >= MAX_KEYS:
            break
    return out


def _items(config) -> list:
    mod = type(config).__module__ or ""
    if mod.startswith("omegaconf"):
        from omegaconf import OmegaConf

        try:
            config = OmegaConf.to_container(config, resolve=True)
        except Exception:  # an interpolation that does not resolve: kept as written
            config = OmegaConf.to_container(config, resolve=False)
    if isinstance(config, dict):
        return [(str(k), v) for k, v in list(config.items())[:MAX_KEYS]]
    if dataclasses.is_dataclass(config):
        return [(f.name, getattr(config, f.name, None)) for f in dataclasses.fields(config)]
    return [(str(k), v) for k, v in list(vars(config).items())[:MAX_KEYS]
            if not str(k).startswith("_")]


def _value(key, value):
    """What the store keeps of `value`: JSON that is short, on one line."""
    if _SECRET.search(key.rsplit(".", 1)[-1]) and value not in (None, "", False):
        return "***"
    if isinstance(value, _SCALARS) and not isinstance(value, str):
        kept = value
    elif isinstance(value, str):
        kept = value if len(value) <= MAX_TEXT else value[:MAX_TEXT - 3] + "..."
    elif isinstance(value, (list, tuple)) and len(value) <= MAX_ITEMS \
            and all(isinstance(v, _SCALARS) for v in value):
        kept = list(value)
    elif _plain(value):
        kept = str(value.value) if _is_enum(value) else str(value)
    else:
        kept = _short(value)
    try:
        text = json.dumps(kept)
    except (TypeError, ValueError):  # an int past the digits json writes
        return _short(value)
    return kept if len(text) <= 4 * MAX_TEXT else _short(value)


def _plain_types() -> tuple:
    import enum
    import pathlib

    return (pathlib.PurePath, enum.Enum)


def _is_enum(value) -> bool:
    import enum

    return isinstance(value, enum.Enum)


def _short(value) -> str:
    """A short one-line repr, whatever the object (its repr may raise)."""
    try:
        text = _SHORT.repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return " ".join(text.split())[:MAX_TEXT]
