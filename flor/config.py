"""A run's configuration: what the script parsed from its command line (or
built as a config object), defaults included, as the main loop began.

    def capture(frame):                    # the first main-loop iteration's caller
        for f in frame and the frames that called it, innermost first:
            only the user's code: not flor's (its CLI's options are not the script's),
            not the standard library's or an installed package's
            for name, value in f's locals (then __main__'s globals):
                argparse.Namespace, jsonargparse's Namespace,
                an OmegaConf DictConfig (Hydra), a dataclass instance of scalars
                    -> flatten(value): {"lr": 0.1, "model.n_embd": 32, ...}
        merged, the innermost binding of a key winning; None if none was found

The words on the command line say only what the user typed: a run made
with the defaults had no value for them.  Nothing is patched: the objects
are read where the script keeps them, once.  A value that is not a number,
a string, a bool or None is kept as its str() (a Path, a device, an enum).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig

__all__ = ["capture", "flatten"]

_FLOR = os.path.dirname(os.path.abspath(__file__)) + os.sep
MAX_KEYS = 500  # a config with more is cut there (a script's namespace holding a dataset)
MAX_DEPTH = 4
_SCALARS = (bool, int, float, str, type(None))


def capture(frame) -> dict | None:
    """The script's configuration, from `frame` outward (see the module's
    docstring), or None where the script keeps none flor recognises."""
    found: dict = {}
    seen: set = set()
    main = sys.modules.get("__main__")
    scopes = []
    f = frame
    while f is not None:
        if _users(f.f_code.co_filename):
            scopes.append(f.f_locals)
        f = f.f_back
    if main is not None and _users(getattr(main, "__file__", None) or "<main>"):
        scopes.append(vars(main))
    for scope in scopes:
        for value in list(scope.values()):
            if id(value) in seen or not _is_config(value):
                continue
            seen.add(id(value))
            for key, v in flatten(value).items():
                found.setdefault(key, v)
    if not found:
        return None
    return dict(list(found.items())[:MAX_KEYS])


def _libraries() -> tuple:
    """Where installed code lives: the standard library, site-packages."""
    paths = sysconfig.get_paths()
    dirs = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if k in paths}
    return (_FLOR, *(d + os.sep for d in dirs))


def _users(filename: str) -> bool:
    """Whether code of `filename` is the user's: neither flor's (its CLI's
    options are not the script's) nor a library's (Lightning's loops keep
    dataclasses of counters; the user's configuration is in the script and
    the project's modules)."""
    if filename.startswith("<"):  # python -c, a notebook's cell; not importlib's
        return not filename.startswith("<frozen")
    return not os.path.abspath(filename).startswith(_libraries())


def _is_config(value) -> bool:
    import argparse

    if isinstance(value, argparse.Namespace):
        return True
    mod = type(value).__module__ or ""
    if mod.startswith("jsonargparse") and type(value).__name__ == "Namespace":
        return True
    if mod.startswith("omegaconf") and type(value).__name__ == "DictConfig":
        return True
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and _scalar_fields(value, 0))


def _scalar_fields(value, depth) -> bool:
    """A dataclass whose fields are scalars or such dataclasses: a config,
    not a model's output or a record of tensors."""
    if depth > MAX_DEPTH:
        return False
    for f in dataclasses.fields(value):
        v = getattr(value, f.name, None)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            if not _scalar_fields(v, depth + 1):
                return False
        elif isinstance(v, dict):
            if not all(isinstance(x, (*_SCALARS, list, tuple)) for x in v.values()):
                return False
        elif not isinstance(v, (*_SCALARS, list, tuple)) and not _plain(v):
            return False
    return True


def _plain(v) -> bool:
    """A value kept as its str() in a config: a path, an enum member."""
    import enum
    import pathlib

    return isinstance(v, (pathlib.PurePath, enum.Enum))


def flatten(config, prefix="", depth=0) -> dict:
    """{dotted key: scalar} of a config object (see `capture`)."""
    items = _items(config)
    out = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if depth < MAX_DEPTH and (_is_config(value) or isinstance(value, dict)):
            out.update(flatten(value, name + ".", depth + 1))
        else:
            out[name] = _scalar(value)
    return out


def _items(config):
    mod = type(config).__module__ or ""
    if mod.startswith("omegaconf"):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=False)
    if isinstance(config, dict):
        return [(str(k), v) for k, v in config.items()]
    if dataclasses.is_dataclass(config):
        return [(f.name, getattr(config, f.name, None)) for f in dataclasses.fields(config)]
    return [(str(k), v) for k, v in vars(config).items() if not str(k).startswith("_")]


def _scalar(value):
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value):
        return list(value)
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."
