"""What a block checkpoint holds, and how it is put back.

    {"block": key, "ctx": context, "occurrence": n,   # whose checkpoint it is
     "sig": ["torch.nn.modules...Net", ...],         # what end() received
     "objs": [model, optimizer, ...],                # the objects (flor.snapshot)
     "modes": [{submodule: training flag}, ...],     # per nn.Module, else None
     "attrs": [{submodule: {name: value}}, ...],     # per nn.Module, else None: its int,
                                                     # float and loose tensor attributes
                                                     # (no state dict holds them)
     "ddp": [flag or None, ...],                     # per DistributedDataParallel: whether
                                                     # its next forward syncs buffers
     "held": [[[path, state], ...] or None, ...],    # per other object: what the state
                                                     # dicts of the modules and optimizers
                                                     # it holds leave out (held_state)
     "rng": {"random": ..., "numpy": ..., "torch": ..., "cuda": ...},
     "grads": [tensor or None, ...]}                 # only when they are read after
                                                     # the block: of parameters(objs)

`payload` builds it at a block's end() in record; in replay `belongs`
checks that a loaded file is the checkpoint of the block execution asking
for it, and `apply` restores the live objects from it.  `read_own` loads it
onto the CPU and adds "devices" (a placement.Devices, not in the file): the
devices its tensors were recorded on, where `apply` puts back what it does
not copy into a live object.
"""
from __future__ import annotations

import array
import random
import sys
from typing import NamedTuple

from .. import _core, trust
from ..checkpoint import read, restore_placed
from ..errors import CheckpointCorrupt, StoreError
from ..handles import Handle
from .aliases import realias
from .placement import Devices

__all__ = ["labels", "payload", "belongs", "apply", "signature", "rng_state", "set_rng_state",
           "fingerprint", "fingerprint_version", "FINGERPRINT", "UNHELD", "unheld"]

#: How a signature (the labels of what a block or a main loop changes) ends
#: the label of a value no checkpoint holds though it matters: an iterator
#: (a generator, a DataLoader's iterator, a file read as it goes), whose
#: position decides what the code after it draws.  Such an execution is
#: never checkpointed, and replay runs it again (flor/runtime/handsfree.py).
UNHELD = "whose position no checkpoint holds"


def unheld(sig) -> list[str]:
    """The labels of a signature that name values no checkpoint holds."""
    return [label for label in sig if isinstance(label, str) and label.endswith(UNHELD)]

#: The version of the state fingerprints a record takes (_core.fingerprint):
#: 3 reads of each tensor storage only the bytes its tensors view (the rest
#: may never have been written: a loss from a reduction keeps a 0-d view of
#: a larger buffer).  Records made before it hold version 2 (whole storages,
#: bit 32 set) or version 1 (run info without "fingerprint").  Versions 2 and
#: 3 read CUDA tensors on their device and equal the host's for the same bytes.
FINGERPRINT = 3


def fingerprint(objs, version=FINGERPRINT, later=False):
    """The state fingerprint of the tensors and arrays of `objs`: an int, or
    with `later` (versions 2 and 3) an object whose value() is the int,
    which does not wait for the GPU kernels queued before it
    (flor._cuda.Later)."""
    return _core.fingerprint(objs, version, later) if later else _core.fingerprint(objs, version)


def fingerprint_version(value) -> int:
    """The version of a recorded fingerprint: version 3 sets bit 33,
    version 2 bit 32."""
    return 3 if value >> 33 else 2 if value >> 32 else 1


def rng_state() -> dict:
    """The global random states, as a checkpoint holds them (`random`'s
    packed: see _packed_random)."""
    state = {"random": _packed_random(random.getstate())}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _packed_random(state):
    """random.getstate() with its 625 words as 2.5 KB of bytes: as a tuple
    of ints, a checkpoint waiting for the writer held 20 KB of objects for
    it (and each was pickled one by one)."""
    version, words, gauss = state
    packed = array.array("I", words)  # 32-bit words: "I" is 4 bytes where flor builds
    if sys.byteorder == "big":
        packed.byteswap()  # little-endian in the file
    return version, packed.tobytes(), gauss


def _unpacked_random(state):
    """random.setstate's argument from a checkpoint's (packed, or a tuple of
    ints as flor wrote it before it packed them)."""
    version, words, gauss = state
    if isinstance(words, bytes):
        unpacked = array.array("I")
        unpacked.frombytes(words)
        if sys.byteorder == "big":
            unpacked.byteswap()
        words = tuple(unpacked)
    return version, words, gauss


def random_fingerprint() -> dict:
    """CRC-32C of each global random state: random, numpy, torch."""
    state = rng_state()
    out = {"random": _core.crc32c(repr(random.getstate()).encode())}
    if "numpy" in state:
        out["numpy"] = _core.crc32c(repr(state["numpy"][2:]).encode() +
                                    state["numpy"][1].tobytes())
    if "torch" in state:
        out["torch"] = _core.crc32c(state["torch"].numpy().tobytes())
    return out


def set_rng_state(state: dict):
    random.setstate(_unpacked_random(state["random"]))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(state["cuda"])


def module_modes(objs):
    """The training flag of every submodule of every nn.Module in objs, which
    state_dict() leaves out but code after the block may depend on."""
    torch = sys.modules.get("torch")
    if torch is None:
        return [None] * len(objs)
    return [{name: m.training for name, m in o.named_modules()}
            if isinstance(o, torch.nn.Module) else None for o in objs]


def set_module_modes(objs, modes):
    # (A name rebound to a module's state dict, with no live module it
    # stands for, has no modes to set.)
    for o, mode in zip(objs, modes or []):
        if mode and _is_module(o):
            for name, m in o.named_modules():
                if name in mode:
                    m.training = mode[name]


#: How far `held` looks for what an object holds: attributes, dict
#: values and list or tuple items, HELD_DEPTH steps deep, in containers of
#: at most HELD_ITEMS items, HELD_VISITS objects in all (a large list of
#: numbers or a deep structure is not walked at each checkpoint).
HELD_DEPTH = 4
HELD_ITEMS = 256
HELD_VISITS = 4096


def _key(k) -> bool:
    """A dict key a path can name: a string, an int, or a tuple of them."""
    return isinstance(k, (str, int)) or (
        isinstance(k, tuple) and all(isinstance(x, (str, int)) for x in k))


def _steps(x) -> list:
    """The ([kind, key], value) steps out of `x` that `held` follows."""
    if isinstance(x, dict):
        return [(["i", k], v) for k, v in x.items() if _key(k)] if len(x) <= HELD_ITEMS else []
    if isinstance(x, (list, tuple)):
        return [(["i", i], v) for i, v in enumerate(x)] if len(x) <= HELD_ITEMS else []
    d = getattr(x, "__dict__", None)
    if type(d) is not dict or len(d) > HELD_ITEMS:
        return []
    return [(["a", k], v) for k, v in d.items() if isinstance(k, str)]


def held(o, kinds) -> list:
    """The objects of `kinds` that `o` (not one of them) holds, as
    [(path, object)], each once: what flor.checkpoint's restore reaches in
    place (an object's attributes, dict values, list and tuple items), not
    looking inside objects of `kinds`, tensors or classes, nor into an
    object whose inspection raises (a dead weak proxy).  A path is a list
    of ["a", attribute] and ["i", key or index] steps."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    out, seen = [], set()
    plain = (str, bytes, int, float, bool, complex, type(None))

    def walk(x, path, depth):
        if id(x) in seen or len(seen) >= HELD_VISITS:
            return
        try:
            if isinstance(x, plain) or isinstance(x, (type, torch.Tensor, Handle)):
                return  # (not counted against the budget: a list of metric tensors)
            seen.add(id(x))
            if isinstance(x, kinds):
                out.append((path, x))
                return
            steps = _steps(x) if depth < HELD_DEPTH else []
        except Exception:  # noqa: BLE001 -- an object whose __getattr__ raises: not walked
            return
        for step, v in steps:
            walk(v, path + [step], depth + 1)

    walk(o, [], 0)
    return [] if out and out[0][0] == [] else out  # `o` is one of them itself


def _at(o, path):
    """What `path` (of held()) names in `o`, or None."""
    try:
        for kind, key in path:
            o = getattr(o, key) if kind == "a" else o[key]
    except Exception:  # noqa: BLE001 -- not there in the live object (or it raises)
        return None
    return o


def held_state(objs) -> list:
    """Per object that is no module or optimizer: [path, state] of each
    module and optimizer it holds (a trainer's model and optimizer), or
    None.  A module's state is its training flags, attributes and DDP flag
    (as module_modes, module_attributes and ddp_flags give them for a
    module passed itself), an optimizer's whether it was stepped since an
    LR scheduler wrapped it (torch's ``_opt_called``): what their state
    dicts leave out."""
    torch = sys.modules.get("torch")
    if torch is None:
        return [None] * len(objs)
    out = []
    for o in objs:
        found = []
        for path, x in held(o, (torch.nn.Module, torch.optim.Optimizer)):
            if isinstance(x, torch.nn.Module):
                found.append([path, {"modes": module_modes([x])[0],
                                     "attrs": module_attributes([x], objs)[0],
                                     "ddp": ddp_flags([x])[0]}])
            else:
                found.append([path, {"opt_called": bool(getattr(x, "_opt_called", False))}])
        out.append(found or None)
    return out


def set_held_state(objs, found):
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for o, entries in zip(objs, found or []):
        for path, state in entries or []:
            x = _at(o, path)
            if isinstance(x, torch.nn.Module) and "modes" in state:
                set_module_modes([x], [state["modes"]])
                set_module_attributes([x], [state["attrs"]])
                set_ddp_flags([x], [state["ddp"]])
            elif isinstance(x, torch.optim.Optimizer) and state.get("opt_called"):
                x._opt_called = True


def module_attributes(objs, scope=None):
    """The attributes of every submodule of every nn.Module in objs that
    its state dict leaves out though they may change as it trains: those
    not named with a leading underscore whose values are ints, floats, or
    tensors that are no parameter's or buffer's (a running center its
    forward() reassigns, `self.center = 0.9 * self.center + ...`).  A
    tensor that shares memory with a parameter or buffer of a module in
    `scope` (objs, and what they hold; a weight tied by a plain attribute),
    or that requires gradients, is the models' own or an activation, and
    is left out.  (Not strings, which are mostly settings of this machine,
    such as a device; not containers, which may be large.)"""
    torch = sys.modules.get("torch")
    out = []
    owned = None
    for o in objs:
        found = {}
        if torch is not None and isinstance(o, torch.nn.Module):
            for name, m in o.named_modules():
                attrs = {}
                for k, v in vars(m).items():
                    if k.startswith("_"):
                        continue
                    if type(v) in (int, float):
                        attrs[k] = v
                    elif _loose_tensor(torch, v):
                        if owned is None:
                            owned = _storages(torch, objs if scope is None else scope)
                        if _storage(v) not in owned:
                            attrs[k] = v
                if attrs:
                    found[name] = attrs
        out.append(found or None)
    return out


def _loose_tensor(torch, v) -> bool:
    """A dense tensor held as a plain attribute that no autograd graph needs."""
    return isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and \
        type(v) is torch.Tensor and v.layout == torch.strided and not v.is_meta and \
        not v.requires_grad and not v.is_quantized and not v.is_nested


def _storage(t):
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _storages(torch, objs) -> set:
    """The storages of the parameters and buffers of the modules in `objs`
    and of those they hold, and of the parameters their optimizers hold."""
    tensors = []
    for o in objs:
        parts = [o] if isinstance(o, (torch.nn.Module, torch.optim.Optimizer)) else \
            [x for _, x in held(o, (torch.nn.Module, torch.optim.Optimizer))]
        for x in parts:
            if isinstance(x, torch.nn.Module):
                tensors += list(x.parameters()) + list(x.buffers())
            else:
                tensors += [p for g in x.param_groups for p in g["params"]]
    return {_storage(t) for t in tensors if isinstance(t, torch.Tensor)}


def _is_module(o) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(o, torch.nn.Module)


def set_module_attributes(objs, attrs):
    for o, found in zip(objs, attrs or []):
        if not _is_module(o):
            continue
        for name, values in (found or {}).items():
            try:
                m = o.get_submodule(name)
            except AttributeError:  # not in the edited program's module
                continue
            for k, v in values.items():
                live = getattr(m, k, None)
                torch = sys.modules.get("torch")
                if torch is not None and isinstance(v, torch.Tensor) and \
                        isinstance(live, torch.Tensor):
                    v = v.to(live.device)  # read onto the CPU
                setattr(m, k, v)


def ddp_flags(objs):
    """Whether each DistributedDataParallel among objs broadcasts rank 0's
    buffers at its next forward: DDP sets it in a forward with gradients and
    clears it in one without, so an evaluation after a skipped training
    block would otherwise use this rank's own buffers."""
    torch = sys.modules.get("torch")
    ddp = torch.nn.parallel.DistributedDataParallel if torch is not None else ()
    return [getattr(o, "require_forward_param_sync", None) if isinstance(o, ddp) else None
            for o in objs]


def set_ddp_flags(objs, flags):
    for o, flag in zip(objs, flags or []):
        if isinstance(flag, bool) and _is_module(o):
            o.require_forward_param_sync = flag


def signature(objs) -> list:
    """What end() received: the type of each object (or, hands-free, what
    each captured name and path is)."""
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in objs]


def labels(sig, objs) -> list[str]:
    """How messages name `objs`: by the names of a hands-free signature,
    else by position and type."""
    if list(sig) == signature(objs):
        return [f"object {i} given to end()" for i in range(len(objs))]
    return [str(label) for label in sig]


def parameters(objs) -> list:
    """The parameters that the modules and optimizers among `objs` hold,
    each once, in a fixed order.  (A bare tensor is left out: restored by
    rebinding, it comes back a leaf whatever it was.)"""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    out, seen = [], set()
    for o in objs:
        if isinstance(o, torch.nn.Module):
            params = list(o.parameters())
        elif isinstance(o, torch.optim.Optimizer):
            params = [p for group in o.param_groups for p in group["params"]]
        else:
            continue
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def state_owners(objs, frame) -> list:
    """What holds training state: `objs`, then the modules and optimizers in
    the scope of `frame` (its locals, the attributes of its `self`, its
    module's globals), in name order.  Their parameters are those whose
    gradients a block leaves."""
    torch = sys.modules.get("torch")
    if torch is None:
        return list(objs)
    kinds = (torch.nn.Module, torch.optim.Optimizer)
    ns, g = frame.f_locals, frame.f_globals
    spaces = [ns]
    me = ns.get("self")
    if me is not None and hasattr(me, "__dict__") and not isinstance(me, kinds):
        spaces.append(vars(me))
    if g is not ns:
        spaces.append(g)
    owners = list(objs)
    for space in spaces:
        owners += [space[name] for name in sorted(space) if isinstance(space[name], kinds)]
    return owners


def gradients(owners) -> list:
    """The gradient of each of `parameters(owners)`, or None where it has none."""
    return [p.grad for p in parameters(owners)]


def payload(key: str, ctx: str, occurrence: int, sig: list, objs, grads=None) -> dict:
    out = {"block": key, "ctx": ctx, "occurrence": occurrence, "sig": sig,
           "objs": list(objs), "modes": module_modes(objs), "rng": rng_state()}
    attrs = module_attributes(objs)
    if any(a is not None for a in attrs):
        out["attrs"] = attrs
    flags = ddp_flags(objs)
    if any(f is not None for f in flags):
        out["ddp"] = flags
    inner = held_state(objs)
    if any(h is not None for h in inner):
        out["held"] = inner
    if grads is not None:
        out["grads"] = grads
    return out


def tag(key: str, ctx: str, occurrence: int) -> bytes:
    """The header tag of the checkpoint of one execution of block `key`."""
    return trust.tag_of("block", key, ctx, occurrence)


def payload_tag(saved: dict) -> bytes:
    return tag(saved["block"], saved["ctx"], saved["occurrence"])


TAGS = 2  # the header tags a record writes: 2, bound to its run (1: not)


def tag_run(run_id: str, info) -> str | None:
    """The run a record's header tags are bound to (rank 0's, for every rank
    of a data-parallel record), or None for a record made before they were."""
    return (info.group or run_id) if info.tags >= 2 else None


def expected(tag_: bytes, run: str | None) -> bytes:
    """The header tag a file of `run` has for `tag_` (blockstate.tag)."""
    return trust.bound(tag_, run) if run is not None else tag_


# What read_own raises for a file that cannot be restored from.
UNREADABLE = (FileNotFoundError, CheckpointCorrupt, trust.Mismatch, trust.Forged,
              trust.UnsafeCheckpoint, StoreError)


def read_own(path: str, expect: bytes, devices: bool = True, sealed: bool = False):
    """Read a checkpoint that a record wrote onto the CPU: in full where its
    signature verifies with this user's key, in safe mode otherwise.
    Returns the payload, with the recorded devices of its tensors as
    "devices" (unless not `devices`), and how it was read ("signed" or
    "safe").  A file whose header tag is not `expect` raises trust.Mismatch
    before anything is unpickled; a file safe mode refuses raises
    trust.UnsafeCheckpoint; where this user's key `sealed` the run, a file
    whose signature does not verify raises trust.Forged."""
    seen: list = []
    where = Devices() if devices else None
    saved = read(path, where.hook if where is not None else "cpu", "signed", expect, seen,
                 sealed)
    if where is not None and isinstance(saved, dict):
        saved["devices"] = where
    return saved, seen[0]


def belongs(loaded, key: str, ctx: str, occurrence: int) -> bool:
    return (isinstance(loaded, dict) and loaded.get("block") == key
            and loaded.get("ctx") == ctx and loaded.get("occurrence") == occurrence)


class Expected(NamedTuple):
    """What replay knows of a hands-free block at its start: the labels its
    end() will hand (`sig`), and the objects captured now with whether the
    block rebinds each (`live`, `rebind`)."""

    sig: list
    live: list
    rebind: list


def _saved_inside(objs, depth=HELD_DEPTH) -> set:
    """The ids of what the saved `objs` hold (dict values, list and tuple
    items, attributes), `depth` steps deep."""
    out: set = set()
    todo = [(o, 0) for o in objs]
    while todo and len(out) < HELD_VISITS:
        x, d = todo.pop()
        if id(x) in out:
            continue
        out.add(id(x))
        if d < depth:
            todo += [(v, d + 1) for _, v in _steps(x)]
    return out


def unrestorable(saved: dict, expected: Expected) -> str | None:
    """Why the checkpoint `saved` cannot put back what the block rebinds,
    given the objects it starts with, or None.  A module the block binds a
    name to (``ema = copy.deepcopy(model)``, the first time) is saved as
    its state dict: a restore loads it into the module the name holds, and
    with none there (None, or a state dict's ModuleDict) it would bind the
    state dict.  A name for a module that another object restored in place
    holds (``m`` after ``for m in models.values()``) is put back as that
    module (apply), and is restorable."""
    torch = sys.modules.get("torch")
    modes = saved.get("modes") or []
    inner = saved.get("held") or []
    if torch is None:
        return None
    in_place = None
    for i, (live, again) in enumerate(zip(expected.live, expected.rebind)):
        if not again:
            continue
        # Modules a rebound tuple, list or object holds (emas = (copy, copy)):
        # loaded into the live ones at the same places, if there are any.
        for path, state in (inner[i] if i < len(inner) else None) or []:
            if "modes" in state and not isinstance(_at(live, path), torch.nn.Module):
                return (f"{expected.sig[i]} is bound in the block to what holds a module, "
                        "which its checkpoint holds as a state dict, and there is no module "
                        "here to load it into")
        if i >= len(modes) or modes[i] is None or isinstance(live, torch.nn.Module):
            continue
        if in_place is None:
            in_place = _saved_inside([o for o, a in zip(saved["objs"], expected.rebind)
                                      if not a])
        if id(saved["objs"][i]) not in in_place:
            return (f"{expected.sig[i]} is bound to a module in the block, which its "
                    "checkpoint holds as a state dict, and there is no module here to load "
                    "it into")
    return None


def _rebind(live, saved, place, holds=False):
    """A rebound name's restored value: the saved one, on its recorded
    devices, except that an object restored through its state dict is
    loaded into the live object, a handle's values are set on it, and what
    holds modules (`holds`: a tuple of EMA copies) is restored into the live
    one, its modules loaded in place."""
    try:
        loads = callable(getattr(live, "load_state_dict", None))
    except Exception:  # noqa: BLE001 -- a __getattr__ that raises other than AttributeError
        loads = False
    if (loads and isinstance(saved, dict) and not isinstance(live, dict)) \
            or isinstance(saved, Handle) or holds:
        return restore_placed(live, saved, place)
    return saved if place is None else place(saved)


def apply(saved: dict, objs, rebind=None, frame=None) -> list:
    """Restore `objs` from a checkpoint: in place where they can change
    (``rebind[i]`` returns the saved value instead), then their modules'
    training flags, the gradients it holds (of the parameters that
    `state_owners(objs, frame)` hold) and the random state.  Returns
    the restored objects."""
    rebind = rebind or [False] * len(objs)
    devices = saved.get("devices")
    place = devices.placer() if devices is not None else None
    loaded: dict = {}  # id(a state dict saved): the live object loaded from it
    items = list(zip(objs, saved["objs"], rebind))
    out = [None] * len(items)
    try:
        for i, (live, s, again) in enumerate(items):
            if not again:
                out[i] = restore_placed(live, s, place, loaded)
        inner = saved.get("held") or []
        for i, (live, s, again) in enumerate(items):
            if again:
                # A name for an object restored in place above (m after
                # `for m in models.values()`) names that object again.
                holds = bool(inner[i]) if i < len(inner) else False
                out[i] = loaded[id(s)] if id(s) in loaded else \
                    _rebind(live, s, place, holds)
        # (best = model.state_dict(): follows the live parameters again)
        out = realias([(live, s) for live, s, again in items if not again], loaded, out)
    finally:
        if devices is not None:
            devices.done()
    set_module_modes(out, saved.get("modes"))
    set_module_attributes(out, saved.get("attrs"))
    set_ddp_flags(out, saved.get("ddp"))
    set_held_state(out, saved.get("held"))
    if "grads" in saved:
        params = parameters(state_owners(out, frame))
        if len(params) != len(saved["grads"]):
            raise ValueError(f"the checkpoint holds the gradients of {len(saved['grads'])} "
                             f"parameters, the block's objects have {len(params)}")
        for p, g in zip(params, saved["grads"]):
            p.grad = None if g is None else g.to(p.device)
    set_rng_state(saved["rng"])
    torch = sys.modules.get("torch")
    for o in out:
        if torch is not None and isinstance(o, torch.optim.Optimizer):
            # The block stepped this optimizer in record; torch's LR
            # schedulers read this flag to warn about a missing step().
            o._opt_called = True
    return out
