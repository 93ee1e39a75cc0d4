"""The runtime of hands-free mode: what instrumented scripts call as ``__flor__``.

instrument.py rewrites the script; this module runs it.  A candidate main
loop is tracked (as by flor.generator) when it runs at the top level of the
program, and is a plain loop otherwise (inside a function that a SkipBlock
called, or a DataLoader worker).  Its blocks are SkipBlocks only while their
own loop is tracked; otherwise they just run.

At the end of a block the side-effect set from the static analysis is read
from the caller's frame and completed with PyTorch's relations:

- an optimizer brings the modules whose parameters it holds (found among the
  caller's locals and the script's globals; parameters held by no module
  found are captured as tensors);
- an LR scheduler brings its optimizer (and so its modules);
- a GradScaler in scope is included;
- every checkpoint holds the random state (torch, CUDA, numpy, random).

Names the block assigns are restored by rebinding them (modules, optimizers
and other objects with ``load_state_dict`` are loaded in place); names it
changes through method calls are restored in place.
"""
from __future__ import annotations

import ast
import collections.abc
import io
import itertools
import logging
import os
import random
import sys
import threading
import types

from ..program.syntax import root as root_of
from .blockstate import UNHELD, Expected, held
from .session import Session

__all__ = ["UNBOUND", "loop", "resume", "step_into", "end", "abandon", "count"]


class _Unbound:
    """The value of a name that was not bound when its block ended."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self):
        return "UNBOUND"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return "<unbound>"


UNBOUND = _Unbound()
count = itertools.count
_compiled: dict = {}

# Values that are not training state: never captured.
_NOT_STATE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType, type, io.IOBase, logging.Logger, threading.Thread,
              types.GeneratorType)
_NOT_STATE_MODULES = ("tqdm", "torch.utils.tensorboard", "tensorboardX", "wandb",
                      "torch.utils.data", "logging", "csv", "_csv")


def loop(iterable, key, names=None, paths=(), globals_=(), rebound=(), iterated=(), grads=False):
    """A candidate main loop; `names`, `paths`, `globals_`, `rebound`: what
    its body carries into the next iteration (None when analysis gave up);
    `iterated`: what it loops over that the next iteration reads; `grads`:
    whether the next iteration reads the gradients this one leaves."""
    s = Session.get()
    if not s.at_top_level():
        return iterable
    carrier = _Carried(names, paths, globals_, rebound, iterated, grads) \
        if names is not None else None
    return s.loop(iterable, key, sys._getframe(1), carrier)


def resume(key):
    """The first statement of a main loop's body: after a restore of its
    iteration checkpoint, the values of the names it rebinds, else None.
    Where nothing was restored (a step loop's every other step) it asks no
    more than that: Session.get() makes a system call (getpid)."""
    s = Session._current
    if type(s) is Session and s.loops.resumed is None:
        return None
    return Session.get().take_resumed(key)


class _Carried:
    """What a hands-free main loop carries, read from the loop's frame."""

    #: Its signature is the script's names for the objects (flor.checkpoint's keys).
    named = True

    def __init__(self, names, paths, globals_, rebound, iterated=(), grads=False):
        self.sets = (names, paths, globals_, rebound)
        self.iterated = iterated
        self.grads = grads  # the iteration checkpoint holds the parameters' gradients

    def _read(self, scope):
        items, captured, extra, labels = _capture(None, *self.sets, scope,
                                                  iterated=self.iterated)
        objs = [items[i][1] for i in captured] + [o for _, o in extra]
        rebind = [items[i][2] for i in captured] + [False] * len(extra)
        return items, captured, objs, labels, rebind

    def capture(self, scope):
        _, _, objs, labels, rebind = self._read(scope)
        return objs, labels, rebind

    def labels(self, sig) -> list[str]:
        return list(sig)

    def apply(self, saved, scope):
        from .blockstate import apply

        items, captured, objs, _, rebind = self._read(scope)
        out = apply(saved, objs, rebind, scope)
        return _put_back(items, captured, out, len(self.sets[0]), scope), out

    def scope_after(self, values, scope):
        """`scope` as the loop's body will see it once the names it rebinds
        take `values` (from apply): what the record fingerprinted."""
        ns, g = scope.f_locals, scope.f_globals
        bound = {n: v for n, v in zip(self.sets[0], values) if v is not UNBOUND}
        f_locals = {**ns, **bound}
        return types.SimpleNamespace(f_locals=f_locals,
                                     f_globals=f_locals if ns is g else g)


def step_into(key, owner, names, paths, globals_, rebound, dead=(), iterated=()) -> bool:
    """A session SkipBlock when its own loop is the innermost one tracked;
    otherwise the block runs as plain code."""
    s = Session.get()
    if s.innermost_loop() != owner:
        s.open_plain()
        return True
    frame = sys._getframe(1)
    expect = None
    if s.replaying:  # what end() would capture if the block were skipped
        items, captured, _, labels = _capture(s, names, paths, globals_, rebound, frame, dead,
                                              iterated)
        expect = Expected(labels, [items[i][1] for i in captured],
                          [items[i][2] for i in captured])
    return s.step_into(key, False, frame, expect_sig=expect)


def abandon():
    """The block's body raised: close it without a checkpoint."""
    Session.get().abandon()


def _value(path, g, ns):
    code = _compiled.get(path)
    if code is None:
        code = _compiled[path] = compile(path, "<flor path>", "eval")
    try:
        return eval(code, g, ns)
    except (NameError, AttributeError, KeyError, IndexError, TypeError):
        return UNBOUND
    except Exception as e:  # noqa: BLE001 -- a property that raises: the script runs on
        return Unreadable(e)


class Unreadable:
    """What a path reads as where reading it raised (a property that
    raises): no checkpoint holds it, so replay runs its block again."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error

    def __str__(self):
        return f"a value that cannot be read ({type(self.error).__name__}: {self.error})"


def _set(path, value, g, ns):
    node = ast.parse(path, mode="eval").body
    container = _value(ast.unparse(node.value), g, ns)
    if container is UNBOUND or isinstance(container, Unreadable):
        return
    if isinstance(node, ast.Attribute):
        setattr(container, node.attr, value)
    else:
        container[node.slice.value] = value


def _state(value) -> bool:
    """Whether to capture `value` (UNBOUND is captured, as a marker)."""
    if value is UNBOUND:
        return True
    if isinstance(value, (_NOT_STATE, Unreadable)):
        return False
    mod = type(value).__module__ or ""
    return not any(mod == m or mod.startswith(m + ".") for m in _NOT_STATE_MODULES)


# Iterators a snapshot holds with their position (they pickle with it).
_HELD_ITERATORS = tuple({type(iter(x)) for x in ([], (), range(0), "", b"", bytearray(), {},
                                                  {}.values(), {}.items(), set())})


def _unheld(value) -> bool:
    """A value whose position matters and no checkpoint holds: an iterator
    other than a plain sequence's (a generator, a DataLoader's, enumerate
    or itertools over one), a file read as it goes (not one written, nor an
    in-memory buffer)."""
    if value is UNBOUND:
        return False
    if isinstance(value, (io.StringIO, io.BytesIO)):
        return False
    if isinstance(value, io.IOBase):
        try:
            mode = getattr(value, "mode", "r")
            return value.readable() and not any(c in str(mode) for c in "wax")
        except (ValueError, OSError):  # closed
            return False
    return isinstance(value, collections.abc.Iterator) and not isinstance(value, _HELD_ITERATORS)


def _completion(values, ns, g):
    """(label, object) pairs that PyTorch's relations add to `values`."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    have = {id(v) for v in values}
    pool = []  # (name, object) of the caller's scope, then the script's globals
    for space in (ns, g) if ns is not g else (g,):
        for name in sorted(space):
            pool.append((name, space[name]))
    extra = []

    def name_of(obj, fallback):
        return next((name for name, o in pool if o is obj), fallback)

    def add(label, obj):
        if id(obj) not in have:
            have.add(id(obj))
            extra.append((label, obj))

    scheduler_types = tuple(t for t in (getattr(torch.optim.lr_scheduler, "LRScheduler", None),
                                        getattr(torch.optim.lr_scheduler, "_LRScheduler", None),
                                        getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau",
                                                None)) if t is not None)
    # The optimizers and schedulers captured, or held by what is captured
    # (a dict of them, a trainer's attributes).
    kinds = (torch.optim.Optimizer,) + scheduler_types
    found = [o for v in values
             for o in ([v] if isinstance(v, kinds) else [o for _, o in held(v, kinds)])]
    have |= {id(o) for o in found}  # restored with what holds them
    optimizers = [v for v in found if isinstance(v, torch.optim.Optimizer)]
    for v in found:
        if isinstance(v, scheduler_types) and isinstance(
                getattr(v, "optimizer", None), torch.optim.Optimizer):
            add(f"{name_of(v.optimizer, 'optimizer')}: the optimizer of a scheduler",
                v.optimizer)
            if all(o is not v.optimizer for o in optimizers):
                optimizers.append(v.optimizer)
    for opt in optimizers:
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        covered = set()
        modules = []
        for name, obj in pool:
            if isinstance(obj, torch.nn.Module) and all(obj is not m for _, m in modules):
                mine = {id(p) for p in obj.parameters()}
                if mine & params:
                    modules.append((name, obj))
        # Keep the outermost: a submodule of a module kept is captured with it.
        subs = {id(m) for _, o in modules for m in o.modules() if m is not o}
        for name, obj in modules:
            if id(obj) not in subs:
                add(f"{name}: a module whose parameters an optimizer holds", obj)
                covered |= {id(p) for p in obj.parameters()}
        for v in values:  # a module captured, or one a captured dict or object holds
            for _, m in [((), v)] if isinstance(v, torch.nn.Module) else \
                    held(v, torch.nn.Module):
                covered |= {id(p) for p in m.parameters()}
        loose = [p for group in opt.param_groups for p in group["params"]
                 if id(p) not in covered]
        if loose:
            named = sorted({name for name, o in pool for p in loose if o is p})
            add(f"{', '.join(named) or 'parameters'}: parameters of an optimizer that no "
                "module in scope holds", loose)
    # Random generators of the user's own (torch.Generator, numpy's, random.Random)
    # in scope: with the global random state, everything random a block draws.
    np = sys.modules.get("numpy")
    rngs = (torch.Generator, random.Random) + (
        (np.random.Generator, np.random.RandomState) if np is not None else ())
    for name, obj in pool:
        if isinstance(obj, rngs):
            add(f"{name}: a random generator", obj)
    scalers = tuple(t for t in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                                getattr(getattr(torch.cuda, "amp", None), "GradScaler", None))
                    if isinstance(t, type))
    if scalers:
        for name, obj in pool:
            if isinstance(obj, scalers):
                add(f"{name}: a GradScaler", obj)
    return extra


def _capture(s, names, paths, globals_, rebound, frame, dead=(), iterated=()):
    """(items, indices of the captured ones, completion, labels): what a
    block's end() hands to the session, read from the caller's frame.
    `iterated`: what the block loops over and code after it reads; an
    iterator there is captured if a checkpoint holds it (_own_iterator),
    else labelled as held by none (a list is neither)."""
    ns, g = frame.f_locals, frame.f_globals
    items = [(n, ns[n] if n in ns else g.get(n, UNBOUND), n in rebound) for n in names]
    items += [(p, _value(p, g, ns), p in rebound) for p in paths]
    items += [(f"global {p}", _value(p, g, g), False) for p in globals_]
    captured = [i for i, (_, v, _) in enumerate(items) if _state(v) and not _lost(v)]
    extra = _completion([items[i][1] for i in captured if items[i][1] is not UNBOUND], ns, g)
    lost = [f"{label}: a {type(v).__name__}, {UNHELD}" for label, v, _ in items
            if _lost(v) and label not in dead]  # dead: nothing reads it after the block
    lost += [f"{label}: {v}, {UNHELD}" for label, v, _ in items if isinstance(v, Unreadable)]
    for p in iterated:
        if any(p == label for label, _, _ in items):
            continue
        v = _peek(p, g, ns)
        if _own_iterator(v):  # it keeps its position in its __dict__: held with the block
            if all(v is not o for _, o in extra):
                extra.append((f"{p}: an iterator it loops over", v))
            continue
        inner = list(v.values()) if type(v) is dict and len(v) <= 64 else \
            list(v) if type(v) in (list, tuple) and len(v) <= 64 else [v]
        kinds = sorted({type(x).__name__ for x in inner if _lost(x)})
        if kinds:
            what = f"a {kinds[0]}" if inner == [v] else f"holding {', '.join(kinds)}"
            lost.append(f"{p}: {what} it loops over, {UNHELD}")
    labels = [items[i][0] for i in captured] + [label for label, _ in extra] + lost
    return items, captured, extra, labels


def _lost(value) -> bool:
    """An iterator whose position no checkpoint holds."""
    return _unheld(value) and not _own_iterator(value)


def _peek(path, g, ns):
    """The value of `path` read without running the program's code: names,
    attributes in an object's own __dict__ (not properties), items of
    dicts, lists and tuples; UNBOUND where it cannot be read so."""
    try:
        node = ast.parse(path, mode="eval").body
        steps = []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            steps.append(node)
            node = node.value
        if not isinstance(node, ast.Name):
            return UNBOUND
        v = ns[node.id] if node.id in ns else g.get(node.id, UNBOUND)
        for step in reversed(steps):
            if v is UNBOUND:
                break
            if isinstance(step, ast.Attribute):
                own = object.__getattribute__(v, "__dict__")
                v = own.get(step.attr, UNBOUND) if type(own) is dict else UNBOUND
            elif type(v) in (dict, list, tuple) and isinstance(step.slice, ast.Constant):
                v = v[step.slice.value]
            else:
                v = UNBOUND
        return v
    except Exception:  # no __dict__, a missing key: unknown, and never the script's error
        return UNBOUND


def _own_iterator(value) -> bool:
    """An iterator of a class of the project's own (the script's directory),
    whose objects keep their position in their __dict__ (and hold no
    iterator of a library's): a checkpoint holds it as it holds any object
    (a hand-written loader or stream)."""
    if not _unheld(value) or isinstance(value, types.GeneratorType):
        return False
    try:
        own = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return False
    if type(own) is not dict or any(_unheld(x) for x in own.values()):
        return False  # it draws from an iterator no checkpoint holds
    mod = sys.modules.get(type(value).__module__)
    main = sys.modules.get("__main__")
    home = os.path.dirname(os.path.abspath(getattr(main, "__file__", "") or "."))
    path = os.path.abspath(getattr(mod, "__file__", "") or "")
    return mod is main or (path.startswith(home + os.sep) and "site-packages" not in path)


def end(key, names, paths, globals_, rebound, grads=False, dead=(), iterated=()):
    """Close the block: checkpoint (record) or restore (replay, skipped) its
    side effects, and return the values of `names` to rebind.  `grads`: the
    block's parameters' gradients are read after it, and are state too;
    `dead`: what nothing reads after the block (an iterator there does not
    stop its checkpoint); `iterated`: what it loops over and code after it
    reads (an iterator there stops its checkpoint)."""
    s = Session.get()
    frame = sys._getframe(1)
    if s.close_plain():
        ns, g = frame.f_locals, frame.f_globals
        return tuple(ns[n] if n in ns else g.get(n, UNBOUND) for n in names)
    items, captured, extra, labels = _capture(s, names, paths, globals_, rebound, frame, dead,
                                              iterated)
    objs = [items[i][1] for i in captured]
    s.block_labels.setdefault(key, labels)
    out = s.end(objs + [o for _, o in extra], frame, sig=labels,
                rebind=[items[i][2] for i in captured] + [False] * len(extra), as_list=True,
                hint="record the script again, or add `# flor: skip` to the loop", grads=grads)
    return _put_back(items, captured, out, len(names), frame)


def _put_back(items, captured, out, nnames, frame):
    """Set the restored values `out` of the captured items: paths and
    globals here; the values of the first `nnames` (names) are returned."""
    ns, g = frame.f_locals, frame.f_globals
    values = [v for _, v, _ in items]
    for i, new in zip(captured, out):
        values[i] = new
    for i in range(nnames, len(items)):
        label, old, _ = items[i]
        if values[i] is not old and values[i] is not UNBOUND:
            if not label.startswith("global "):
                if label != root_of(label):  # a bare name here is a closure's: in place only
                    _set(label, values[i], g, ns)
            elif "." in label or "[" in label:
                _set(label[len("global "):], values[i], g, g)
            else:
                g[label[len("global "):]] = values[i]
    return tuple(values[:nnames])

