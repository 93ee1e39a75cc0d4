"""Handles: objects that stand for training state held elsewhere.

Accelerate's ``Accelerator`` is one.  What it wraps (the prepared model,
optimizer, scheduler and data loaders) the script holds under its own
names, and flor captures them there; the Accelerator itself keeps
references to them, process-wide singletons, hooks and weak references,
which are not training state and cannot be pickled.  Its class says as
much: its ``__deepcopy__`` returns the object itself.

Only the classes named in ``KNOWN`` are handles.  Another class whose copy
is itself (an immutable value, or a class of the user's whose state flor
cannot see into) is kept by a snapshot as it is, as before, and its digest
covers all of it, so a restore that misses a part of it is found.

A snapshot (csrc/walk.c) holds a handle as a :class:`Handle`: its class's
name, its own attributes that are plain values (numbers, strings, flags,
None: the Accelerator's gradient-accumulation ``step`` counter), and the
state of the parts ``KNOWN`` names that the script may never name itself
(the GradScaler Accelerate makes for fp16, through its state dict; the
project configuration's counters).  A restore (flor/checkpoint.py) puts
these back on the live handle, only onto attributes it already has, with
values of the types they have, and leaves the rest of it as the script made
it; a digest (flor/runtime/digest.py) counts the same values.
"""
from __future__ import annotations

__all__ = ["Handle", "KNOWN", "of", "capture"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes)

#: Handle classes (module.qualname, matched along the object's class's MRO)
#: and the attributes of theirs whose own state a checkpoint keeps.
KNOWN = {
    "accelerate.accelerator.Accelerator": ("scaler", "project_configuration"),
}


class Handle:
    """What a snapshot keeps of a handle: its class's name, its own
    plain-valued attributes, and the state of its known parts, each as
    ("state_dict", its state dict) or ("values", its own plain values)."""

    def __init__(self, kind: str, attrs: dict, parts: dict | None = None):
        self.kind = kind
        self.attrs = attrs
        self.parts = parts or {}

    def __reduce__(self):  # built from its values: a safe unpickler admits it
        return (Handle, (self.kind, self.attrs, self.parts))

    def __repr__(self):
        return f"<flor handle of a {self.kind}: {', '.join(sorted(self.attrs))}>"

    def apply(self, live, where="obj"):
        """Put the kept values back on `live`, a handle of the same class; return it."""
        if not isinstance(self.kind, str) or _known(type(live)) != self.kind:
            raise ValueError(
                f"cannot restore {where}: the checkpoint holds a handle of a {self.kind}, "
                f"the script has a {type(live).__qualname__} there"
            )
        if not isinstance(self.attrs, dict) or not isinstance(self.parts, dict):
            raise ValueError(f"cannot restore {where}: a damaged handle of a {self.kind}")
        _set_plain(live, self.attrs, where)
        for name, entry in self.parts.items():
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ValueError(f"cannot restore {where}: a damaged handle of a {self.kind}")
            how, saved = entry
            part = vars(live).get(name) if isinstance(name, str) else None
            load = getattr(part, "load_state_dict", None)
            if how == "state_dict" and callable(load) and isinstance(saved, dict):
                load(saved)
            elif how == "values" and part is not None and isinstance(saved, dict):
                _set_plain(part, saved, f"{where}.{name}")
            else:
                raise ValueError(f"cannot restore {where}.{name}: the checkpoint holds its "
                                 f"{how}, and the live {self.kind} has a "
                                 f"{type(part).__name__} there")
        return live


def _set_plain(obj, values: dict, where: str):
    """Set `values` on `obj`: only attributes it has, never a dunder, each a
    plain value of the type the attribute holds (or None either way)."""
    own = vars(obj)
    for name, value in values.items():
        if not isinstance(name, str) or name.startswith("__") or name not in own or \
                type(value) not in _PLAIN:
            raise ValueError(f"cannot restore {where}: the checkpoint sets {name!r}, which "
                             f"a {type(obj).__qualname__} does not hold as a plain value")
        current = own[name]
        if current is not None and value is not None and type(current) is not type(value):
            raise ValueError(f"cannot restore {where}.{name}: a {type(value).__name__} "
                             f"where the live one holds a {type(current).__name__}")
        if current != value or type(current) is not type(value):
            setattr(obj, name, value)


_kinds: dict = {}  # {type: its name in KNOWN, or None}


def _known(t) -> str | None:
    """The name in KNOWN of the handle class `t` is, or None."""
    try:
        return _kinds[t]
    except KeyError:
        pass
    found = None
    for c in t.__mro__:
        name = f"{c.__module__}.{c.__qualname__}"
        if name in KNOWN:
            found = name
            break
    if len(_kinds) > 4096:
        _kinds.clear()
    _kinds[t] = found
    return found


def _plain(obj) -> dict:
    return {n: v for n, v in vars(obj).items() if type(v) in _PLAIN}


def capture(obj):
    """What a snapshot holds of `obj`, whose class's __deepcopy__ returned
    `obj` itself (the walk calls this): its Handle, or `obj` itself where it
    is not a known handle."""
    kind = _known(type(obj))
    if kind is None or not isinstance(getattr(obj, "__dict__", None), dict):
        return obj
    parts = {}
    for name in KNOWN[kind]:
        part = vars(obj).get(name)
        if part is None or type(part) in _PLAIN:
            continue  # a plain value: among the attributes
        if callable(getattr(part, "state_dict", None)) and \
                callable(getattr(part, "load_state_dict", None)):
            parts[name] = ("state_dict", part)  # the walk and the digest take its state dict
        elif isinstance(getattr(part, "__dict__", None), dict):
            parts[name] = ("values", _plain(part))
    return Handle(kind, _plain(obj), parts)


def of(obj):
    """The Handle of `obj` if it is a known handle, else None."""
    return capture(obj) if _known(type(obj)) is not None and \
        isinstance(getattr(obj, "__dict__", None), dict) else None
