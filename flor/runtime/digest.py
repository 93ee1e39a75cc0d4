"""The digest of one carried object: all of its state, not only its tensors.

A state fingerprint (blockstate.fingerprint) reads the bytes of tensors and
arrays.  What a main loop carries into its next iteration is more: step
counters, lists of losses, a Python attribute a module keeps outside its
state dict, a random generator.  An iteration checkpoint stores the digest
of each carried object as the record had it at the end of the iteration;
after a replay worker restores the checkpoint it digests what it put back
and compares, object by object (flor/runtime/carry.py), so a restore that
misses a part of the state is found before an iteration runs on it.

The digest is canonical across processes: sets and dicts are digested in
an order of their elements or keys (string hashes differ between
processes, and a restore in place keeps the live dict's key order),
attributes in name order (``__dict__`` and ``__slots__`` alike), tuples
by value wherever they are met, other shared and cyclic references by the
order they are first met.  Modules are
digested by their state dict, their training flag and the other
attributes that do not start with an underscore (which load_state_dict
does not restore), less the tensors they keep (a cached batch), for every
submodule.
Objects restored through state_dict()/load_state_dict() (optimizers, LR
schedulers, scalers) are digested by their state dict; handles
(flor/handles.py: an Accelerator) by what a checkpoint keeps of them; others,
as pickle reduces them.  Tensor and array bytes are read by the C walk
(_core.fingerprint), except those of `covered` tensors, which a state
fingerprint of the same moment covers (only their dtype and shape count).

An object that cannot be digested (pickle cannot reduce it, reading it
raises, a tensor the C walk cannot read) has no digest: `digest` raises
Opaque naming its type, and the restore says it restored that object
without verifying it.
"""
from __future__ import annotations

import array
import collections
import hashlib
import json
import random
import struct
import sys
import types

from .. import _core, handles

__all__ = ["digest", "covered", "Opaque", "VERSION", "VERSIONS"]

#: The version of these digests that an iteration checkpoint records
#: (``carried_version``; a checkpoint without one has version 1).  Version 2
#: digests a tuple by its value wherever it is met; version 1 counted a
#: tuple met twice as a shared reference, which no restore keeps: an
#: optimizer whose param groups share the default `betas` tuple (two groups,
#: with and without weight decay) never matched its restored self.
VERSION = 2
VERSIONS = (1, 2)
#: The state fingerprint version a digest reads tensors with: whole
#: storages, as a checkpoint holds and restores them (and as the records of
#: every earlier version of flor digested them).
TENSORS = 2

_JSON = (str, int, float, bool, type(None))  # values json writes exactly
_ENCODE = json.JSONEncoder(sort_keys=True).encode
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
              types.ModuleType)


def _cache(name, value) -> bool:
    """A module attribute a digest leaves out: a private one (torch's own),
    or tensors it keeps (the last batch, an attention map: overwritten by
    the next forward(), and no checkpoint holds them), or None (what such
    a cache holds before the first forward())."""
    if name.startswith("_") or value is None:
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    items = value.values() if type(value) is dict else value if type(value) in (list, tuple) \
        else (value,)
    return any(isinstance(v, torch.Tensor) for v in items)


def _by_value(obj, t) -> bool:
    """A tuple, or a tuple subclass that holds nothing but its items (a
    namedtuple, torch.Size, a struct sequence: no __dict__, and Python
    allows a tuple subclass no slots of its own)."""
    return t is tuple or (isinstance(obj, tuple) and not hasattr(obj, "__dict__"))


class Opaque(Exception):
    """An object whose state the digest cannot read (its message: what it is)."""


def covered(owners) -> set:
    """The ids of the tensors that a state fingerprint of `owners` (the
    modules and optimizers in the loop's scope) reads."""
    torch = sys.modules.get("torch")
    ids = set()
    if torch is None:
        return ids
    for o in owners:
        if isinstance(o, torch.nn.Module):
            ids.update(id(t) for t in o.parameters())
            ids.update(id(t) for t in o.buffers())
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                ids.update(id(v) for v in state.values() if isinstance(v, torch.Tensor))
    return ids


def digest(obj, skip=frozenset(), version=VERSION) -> int:
    """The 64-bit digest of `obj`'s state; tensors whose id is in `skip`
    count by dtype and shape only (`version`: one of VERSIONS).  Raises
    Opaque."""
    if version not in VERSIONS:
        raise ValueError(f"no digest version {version!r}: this flor makes {VERSIONS}")
    d = _Digest(skip, version)
    try:
        d.add(obj)
        if d.tensors:
            d.write(struct.pack("<Q", _core.fingerprint(d.tensors, TENSORS)))
    except Opaque:
        raise
    except RecursionError:
        raise Opaque(f"a {type(obj).__name__} nested too deeply") from None
    except Exception as e:  # whatever reading the object raised: never the user's problem
        raise Opaque(f"a {type(obj).__name__} ({type(e).__name__}: {e})") from None
    return int.from_bytes(d.h.digest(), "little")


class _Digest:
    def __init__(self, skip, version):
        # Version 2 and later hash in their own space: no digest of one
        # version equals a digest of another (an older flor, which compares
        # version 1, refuses a newer record's restore instead of misreading it).
        self.h = hashlib.blake2b(digest_size=8, person=b"" if version == 1 else
                                 f"flor-digest-{version}".encode())
        self.skip, self.version = skip, version
        self.walked: dict[int, object] = {}  # tuples walked to their end (kept alive)
        self.again: dict[int, bytes] = {}  # what a walked tuple adds when met again
        self.memo: dict[int, int] = {}
        self.keep = []  # what the memo's ids name stays alive while digesting
        self.tensors = []  # read by the C walk at the end, in the order met

    def write(self, b: bytes):
        self.h.update(b)

    def tag(self, kind: bytes, data: bytes = b""):
        self.write(kind + struct.pack("<Q", len(data)) + data)

    def _tuple(self, obj, t):
        """By value, as the hash of what it holds: once walked to its end,
        everything it reaches is in the memo, so that hash is fixed and is
        reused when it is met again (a tuple met on many paths is neither
        walked nor hashed once per path).  A tuple that holds no tuple is
        digested in line: met again, it costs its length."""
        if not any(isinstance(x, tuple) for x in obj):
            return self._tuple_walk(obj, t)
        cached = self.again.get(id(obj))
        if cached is None:
            walked = id(obj) in self.walked  # to its end, before this meeting
            outer, self.h = self.h, hashlib.blake2b(digest_size=16)
            try:
                self._tuple_walk(obj, t)
                part = self.h.digest()
            finally:
                self.h = outer
            if walked:
                self.again[id(obj)] = part
            else:
                self.walked[id(obj)] = obj
            cached = part
        self.tag(b"u", cached)

    def _tuple_walk(self, obj, t):
        if t is tuple:
            return self._sequence(b"t", obj)
        self.tag(b"o", f"{t.__module__}.{t.__qualname__}".encode())
        return self._sequence(b"l", obj)

    def add(self, obj):
        t = type(obj)
        if obj is None or obj is Ellipsis or t is bool:
            return self.tag(b"c", repr(obj).encode())
        if t is int:
            return self.tag(b"i", str(obj).encode())
        if t is float:
            return self.tag(b"f", struct.pack("<d", obj))
        if t is complex:
            return self.tag(b"z", struct.pack("<dd", obj.real, obj.imag))
        if t is str:
            return self.tag(b"s", obj.encode("utf-8", "surrogatepass"))
        if t is bytes:
            return self.tag(b"b", obj)
        if self.version >= 2 and _by_value(obj, t):  # immutable: what it holds is what counts
            return self._tuple(obj, t)
        ref = self.memo.get(id(obj))
        if ref is not None:  # shared or cyclic: where it was first met
            return self.tag(b"r", str(ref).encode())
        self.memo[id(obj)] = len(self.memo)
        self.keep.append(obj)
        torch = sys.modules.get("torch")
        np = sys.modules.get("numpy")
        if torch is not None and isinstance(obj, torch.Tensor):
            self.tag(b"T", f"{obj.dtype} {tuple(obj.shape)}".encode())
            if id(obj) not in self.skip:
                self.tensors.append(obj)
            return None
        if np is not None and isinstance(obj, np.ndarray):
            self.tag(b"A", f"{obj.dtype} {obj.shape}".encode())
            self.tensors.append(obj)
            return None
        if t in (list, tuple):
            return self._sequence(b"l" if t is list else b"t", obj)
        if t is dict:
            return self._dict(obj)
        if t is collections.OrderedDict:
            return self._items(b"d", obj.items())
        if t in (set, frozenset):
            return self._set(obj)
        if isinstance(obj, _FUNCTIONS):
            name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
            return self.tag(b"n", f"{getattr(obj, '__module__', '')}.{name}".encode())
        return self._object(obj, torch, np)

    def _sequence(self, kind, seq):
        self.tag(kind, str(len(seq)).encode())
        if len(seq) > 16:  # long runs of one plain type, read in C
            first = type(seq[0])
            if first in (float, int, str) and all(type(x) is first for x in seq):
                if first is float:
                    return self.tag(b"F", array.array("d", seq).tobytes())
                return self.tag(b"J", _ENCODE(seq).encode("utf-8", "surrogatepass"))
        for x in seq:
            self.add(x)

    def _dict(self, obj):
        """In an order of its keys: a restore in place keeps the order the
        live dict had (a dict made from a set has its process's order)."""
        keys = list(obj)
        self.tag(b"D", str(len(keys)).encode())
        if all(type(k) is str for k in keys) and all(type(v) in _JSON for v in obj.values()):
            return self.tag(b"j", _ENCODE(obj).encode("utf-8", "surrogatepass"))
        if all(type(k) is str for k in keys) or all(type(k) is int for k in keys):
            keys.sort()
            values = [obj[k] for k in keys]
            self._sequence(b"k", keys)
            return self._sequence(b"v", values)
        parts = []
        for k in keys:
            sub = _Digest(self.skip, self.version)
            sub.add(k)
            parts.append((sub.h.digest(), k))
        for _, k in sorted(parts, key=lambda p: p[0]):
            self.add(k)
            self.add(obj[k])

    def _items(self, kind, items):
        items = list(items)
        self.tag(kind, str(len(items)).encode())
        for k, v in items:
            self.add(k)
            self.add(v)

    def _set(self, obj):
        self.tag(b"S", str(len(obj)).encode())
        if obj and (all(type(x) is str for x in obj) or all(type(x) is int for x in obj)):
            return self._sequence(b"s", sorted(obj))
        parts = []
        for x in obj:
            sub = _Digest(self.skip, self.version)
            sub.add(x)
            if sub.tensors:
                sub.h.update(struct.pack("<Q", _core.fingerprint(sub.tensors, TENSORS)))
            parts.append(sub.h.digest())
        for p in sorted(parts):
            self.write(p)

    def _attributes(self, obj, module=False):
        state = getattr(obj, "__dict__", None)
        if not state:  # none, or empty: alike (a class rebuilt by value may gain one)
            return
        names = sorted(n for n in state if not (module and _cache(n, state[n])))
        self._items(b"a", ((n, state[n]) for n in names))

    def _object(self, obj, torch, np):
        t = type(obj)
        self.tag(b"o", f"{t.__module__}.{t.__qualname__}".encode())
        if torch is not None:
            if isinstance(obj, torch.nn.Module):
                self.add(obj.state_dict(keep_vars=True))
                for name, m in obj.named_modules():
                    self.add(name)
                    self.add(m.training)
                    self._attributes(m, module=True)
                return None
            if isinstance(obj, torch.Generator):
                return self.add(obj.get_state())
            if isinstance(obj, torch.dtype):
                return self.tag(b"n", str(obj).encode())
        if np is not None:
            if isinstance(obj, np.generic):
                return self.tag(b"g", str(obj.dtype).encode() + obj.tobytes())
            if isinstance(obj, np.random.Generator):
                return self.add(obj.bit_generator.state)
            if isinstance(obj, np.random.RandomState):
                return self.add(obj.get_state())
        if isinstance(obj, random.Random):
            return self.add(obj.getstate())
        handle = handles.of(obj)
        if handle is not None:  # what a checkpoint keeps and restores of it
            return self.add((handle.attrs, handle.parts))
        if callable(getattr(obj, "state_dict", None)) and \
                callable(getattr(obj, "load_state_dict", None)):
            return self.add(obj.state_dict())  # how it is checkpointed and restored
        if isinstance(obj, dict):  # a subclass: its items, then its attributes
            self._dict(obj)
            if isinstance(obj, collections.defaultdict):
                self.add(obj.default_factory)
            return self._attributes(obj)
        if isinstance(obj, (list, tuple)):
            self._sequence(b"l", obj)
            return self._attributes(obj)
        try:
            reduced = obj.__reduce_ex__(4)
        except Exception as e:
            raise Opaque(f"a {t.__name__} ({type(e).__name__}: {e})") from None
        if isinstance(reduced, str):  # a global
            return self.tag(b"n", reduced.encode())
        fn, args, *rest = tuple(reduced) + (None,) * (5 - len(reduced))
        self.add(fn)
        self.add(args)
        state, items, pairs = rest[:3]
        if isinstance(state, tuple) and len(state) == 2 and \
                all(part is None or isinstance(part, dict) for part in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # __dict__ and __slots__ alike
        if isinstance(state, dict):
            if state:
                self._items(b"a", sorted(state.items(), key=lambda kv: str(kv[0])))
        else:
            self.add(state)
        if items is not None:
            self._sequence(b"l", list(items))
        if pairs is not None:
            self._items(b"d", pairs)
        return None
