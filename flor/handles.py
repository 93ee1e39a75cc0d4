"""Handles: objects whose class copies them as themselves.

A class whose ``__deepcopy__`` returns the object itself says that a copy
of it is the same object: it is a handle to state that lives elsewhere.
Accelerate's ``Accelerator`` is one.  What it wraps (the prepared model,
optimizer, scheduler and data loaders) the script holds under its own
names, and flor captures them there; the Accelerator itself keeps
references to them, process-wide singletons, hooks and weak references,
which are not training state and cannot be pickled.

An immutable value copies as itself too (a numpy scalar, an enum member):
one without attributes of its own, or an enum member, is no handle, and a
snapshot holds it as it is.

A snapshot (csrc/walk.c) holds a handle as a :class:`Handle`: its class
and the attributes of its own that are plain values (numbers, strings,
flags, None; the Accelerator's gradient-accumulation ``step`` counter).  A
restore (flor/checkpoint.py) sets those attributes on the live handle and
leaves the rest of it as the script made it; a digest
(flor/runtime/digest.py) counts the same values.
"""
from __future__ import annotations

import enum

__all__ = ["Handle", "of", "capture"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_UNSET = object()

#: {type: whether its __deepcopy__ returned the object itself}, as first seen.
_kinds: dict = {}


class Handle:
    """What a snapshot keeps of a handle: its class's name and its own
    plain-valued attributes."""

    def __init__(self, kind: str, attrs: dict):
        self.kind = kind
        self.attrs = attrs

    def __reduce__(self):  # built from its two values: a safe unpickler admits it
        return (Handle, (self.kind, self.attrs))

    def __repr__(self):
        return f"<flor handle of a {self.kind}: {', '.join(sorted(self.attrs))}>"

    def apply(self, live, where="obj"):
        """Set the kept attributes on `live`, a handle of the same class; return it."""
        if _name(type(live)) != self.kind:
            raise ValueError(
                f"cannot restore {where}: the checkpoint holds a handle of a {self.kind}, "
                f"the script has a {type(live).__qualname__} there"
            )
        for name, value in self.attrs.items():
            if getattr(live, name, _UNSET) != value:  # a frozen one stays as it is
                setattr(live, name, value)
        return live


def _name(t) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _attributes(obj):
    """The instance attributes of `obj`, if it can have state of its own: an
    immutable value that copies as itself (a numpy scalar, an enum member, a
    Fraction) is not a handle."""
    state = getattr(obj, "__dict__", None)
    return state if isinstance(state, dict) and state and not isinstance(obj, enum.Enum) \
        else None


def capture(obj):
    """What a snapshot holds of `obj`, whose class's __deepcopy__ returned
    `obj` itself (the walk calls this): its Handle, or `obj` where it is an
    immutable value."""
    state = _attributes(obj)
    if state is None:
        return obj
    _kinds[type(obj)] = True
    return Handle(_name(type(obj)), {n: v for n, v in state.items() if type(v) in _PLAIN})


def of(obj):
    """The Handle of `obj` if it is a handle, else None.  A class is asked
    once (its __deepcopy__ is called with a fresh memo)."""
    t = type(obj)
    known = _kinds.get(t)
    if known is None:
        copier = getattr(t, "__deepcopy__", None)
        try:
            known = callable(copier) and copier(obj, {}) is obj
        except Exception:
            known = False
        _kinds[t] = known
    return capture(obj) if known and _attributes(obj) is not None else None
