"""Restored values go back on the devices the record had them on.

A replay reads block and iteration checkpoints onto the CPU
(blockstate.read_own): most of what they hold is copied into live objects
that are already where they belong (a module's parameters, an optimizer's
state, a tensor restored in place), and loading it onto the GPU first would
take the state's size again in GPU memory.  What becomes live as it was
loaded (a name the block rebinds, a new entry of a dict, a replaced list)
must be where the record had it, or the script's next step mixes devices:
`Devices` notes, while a file loads, the device each storage was recorded
on, and `Devices.place` moves a value's tensors there, one copy per storage,
so that views of one tensor stay views of one another.

A device this process cannot use (a record made on a GPU, replayed where
the script chose the CPU) leaves the tensors on the CPU, as before.
"""
from __future__ import annotations

import sys
import types

__all__ = ["Devices"]

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType)


class Devices:
    """The recorded device of each storage loaded onto the CPU."""

    def __init__(self):
        self._recorded: dict = {}  # storage (its StorageImpl) -> (storage, device name)
        self._usable: dict = {}
        self._walk = None

    def hook(self, storage, recorded: str):
        """A map_location hook (flor.checkpoint.read): the storage stays on
        the CPU, and where it was recorded is noted."""
        if recorded == "cpu":
            return storage
        # Held, so that no other storage can take its StorageImpl's address.
        self._recorded[storage._cdata] = (storage, recorded)
        return storage

    def usable(self, name: str):
        """The torch.device `name`, or None where this process cannot use it."""
        if name not in self._usable:
            torch = sys.modules["torch"]
            device = torch.device(name)
            backend = getattr(torch, device.type, None)
            ok = callable(getattr(backend, "is_available", None)) and backend.is_available()
            count = getattr(backend, "device_count", None)
            if ok and device.index is not None and callable(count):
                ok = device.index < count()
            self._usable[name] = device if ok else None
        return self._usable[name]

    def placer(self):
        """`place`, or None where every storage was recorded on the CPU."""
        return self.place if self._recorded else None

    def place(self, value):
        """`value` with every tensor loaded from a storage recorded on a
        usable device moved there (containers are changed in place, tuples
        rebuilt)."""
        if not self._recorded:
            return value
        if self._walk is None:  # one per load: a storage is moved once
            self._walk = _Walk(self)
        return self._walk(value)

    def done(self):
        """Forget what was placed (the walk refers back to this object)."""
        self._walk = None


class _Walk:
    def __init__(self, devices: Devices):
        self.devices = devices
        self.memo: dict = {}  # id -> placed value (the originals live in the payload)
        self.storages: dict = {}  # StorageImpl -> the storage on its device

    def __call__(self, value):
        key = id(value)
        if key not in self.memo:
            self.memo[key] = value  # a container that holds itself
            self.memo[key] = self._place(value)
        return self.memo[key]

    def _place(self, v):
        torch = sys.modules["torch"]
        if isinstance(v, torch.Tensor):
            return self._tensor(torch, v)
        if isinstance(v, dict):
            if any(isinstance(k, torch.Tensor) for k in v):  # keyed by parameters
                items = [(self(k), self(x)) for k, x in v.items()]
                v.clear()
                v.update(items)
            else:
                for k, x in v.items():
                    y = self(x)
                    if y is not x:
                        v[k] = y
            return v
        if isinstance(v, list):
            for i, x in enumerate(v):
                y = self(x)
                if y is not x:
                    v[i] = y
            return v
        if isinstance(v, (tuple, set, frozenset)):
            items = [self(x) for x in v]
            if all(a is b for a, b in zip(items, v)):
                return v
            if isinstance(v, set):
                v.clear()
                v.update(items)
                return v
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        if hasattr(v, "__dict__") and not isinstance(v, _OPAQUE):
            self(vars(v))
        return v

    def _tensor(self, torch, t):
        if t.device.type != "cpu" or t.layout is not torch.strided or t.is_quantized:
            return t  # only dense tensors load from one storage of a file
        try:
            storage = t.untyped_storage()
            ptr = storage._cdata
        except RuntimeError:  # a wrapper subclass: no storage of its own
            return t
        entry = self.devices._recorded.get(ptr)
        device = self.devices.usable(entry[1]) if entry is not None else None
        if device is None:
            return t
        with torch.no_grad():
            if ptr not in self.storages:  # its bytes, moved once
                flat = torch.empty(0, dtype=torch.uint8).set_(storage)
                self.storages[ptr] = flat.to(device).untyped_storage()
            out = torch.empty(0, dtype=t.dtype, device=device)
            out.set_(self.storages[ptr], t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return type(t)(out, t.requires_grad)
        if type(t) is not torch.Tensor:
            out = out.as_subclass(type(t))
        return out.requires_grad_(t.requires_grad)
