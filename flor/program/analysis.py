"""Static side-effect analysis for hands-free mode (the Flor paper, Table 2).

A block's *changeset* is what it may change that code after it can see.  The
statements of the block are walked one by one; each activates at most one
rule, in this order of precedence:

    rule  statement                                   adds to the changeset
    0     v1, ..., vn = ...   with some vi already in it   the other vi
    1     v1, ..., vn = obj.method(...)               obj, v1, ..., vn
    2     v1, ..., vn = func(...)                     v1, ..., vn
    3     v1, ..., vn = expression                    v1, ..., vn
    4     obj.method(...)                             obj
    5     func(...)                                   nothing: no estimate

Targets and receivers are *paths*: a name, then attributes and constant
subscripts (``net``, ``self.best``, ``hist["acc"]``); a subscript by a
variable stops the path at its container.  Names bound to modules, functions
and classes (imports, ``def``, ``class``) are not state and are left out; an
attribute of a class of the script is state (``Counter.calls += 1``).  What
is changed in place through a name bound to another path (``s = STATS`` then
``s["n"] += 1``) counts as changed under that path too (_through_aliases).

Functions of the script itself.  A call to a function defined in the same
file (at module level, or in the function that holds the block), or imported
from a module of the project (`Modules`: ``engine.train_one_epoch(...)``,
analysed in its own module), is analysed through the function's body, and through the functions it calls in turn
(recursive ones to a fixpoint), wherever the call appears in a statement: what it does to its parameters counts as done
to the caller's arguments, and the module globals it assigns (``global g``)
or changes through a method call count as themselves.  Everything it does
to its own locals is dropped.  The analysis *gives up* on a block, which is
then left as ordinary code and re-executed on replay, never skipped, when:
the block returns, yields or awaits; it, or a function it calls, uses
``exec``, ``eval``, ``globals()``, ``locals()``, ``vars()`` or ``nonlocal``;
a function of another module changes that module's globals;
or an argument that a function changes is passed through
``*args``/``**kwargs``.

Loop-scoped variables (assigned in the block, and read nowhere else in their
scope, nor by a function of the script when the scope is the module) are
then removed.  What remains is completed at run time with PyTorch's own
relations (see handsfree.py): an optimizer adds its modules, a scheduler its
optimizer, a GradScaler itself, and every checkpoint holds the random state.
Calls to code outside the script (rule 5) are assumed not to change the
caller's state except through their receiver, and a few library functions
known to change their first argument in place (``random.shuffle(order)``,
``heapq.heappush(h, x)``: `_IN_PLACE`) change that argument; the deferred
checks of replay catch the cases where that assumption fails.
"""
from __future__ import annotations

import ast
import copy
import os
import re
from dataclasses import dataclass, field

from . import hooks
from .calls import MISSING, Calls, Modules
from .iterators import advanced, iterated
from .syntax import (assigned_names, called_names, comprehension_names, free_names, method_kind,
                     own_nodes, path_of, root, simple_statements, stops, walk_scope)
from .syntax import targets as single_targets

__all__ = ["Effects", "GiveUp", "MISSING", "Modules", "Script", "block_effects", "globals_changed",
           "read_first"]
OPAQUE = {"exec", "eval", "globals", "locals", "vars"}


class GiveUp(Exception):
    """The block's side effects cannot be estimated soundly."""


@dataclass
class Effects:
    """A block's estimated changeset."""

    paths: list[str] = field(default_factory=list)  # in the block's scope, in order
    globals: list[str] = field(default_factory=list)  # module globals set by callees
    rules: dict[str, int] = field(default_factory=dict)  # path -> rule that added it
    assigned: set[str] = field(default_factory=set)  # paths the block rebinds
    dropped: list[str] = field(default_factory=list)  # loop-scoped, removed
    unknown: list[int] = field(default_factory=list)  # lines of calls with no estimate
    calls: set[str] = field(default_factory=set)  # script functions called, transitively
    reads: set[str] = field(default_factory=set)  # names the block references
    iterated: set[str] = field(default_factory=set)  # what it loops over (iterators.py)

    def add(self, path, rule):
        if path not in self.rules:
            self.rules[path] = rule
            self.paths.append(path)


class Script(Calls):
    """A parsed script (or module of the project: `path`, with the other
    `modules` calls are followed into): its functions and what they change
    (how its calls resolve: calls.Calls)."""

    def __init__(self, tree: ast.Module, path: str | None = None, modules: Modules | None = None):
        super().__init__(tree, path, modules)
        self.module_names = assigned_names(tree.body)  # names bound at module level
        self.global_reads: set[str] = set()  # module names that functions read
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                self.global_reads |= free_names(n)
        self._summaries: dict = {}  # id(function) -> its summary, final
        self._partial: dict = {}  # id(function) -> its summary so far, while summarised
        self._hits: list = []  # ids of unfinished summaries that a recursive call used

    # -- functions --------------------------------------------------------

    # (what a call runs: calls.Calls)

    def summary(self, fn: ast.FunctionDef, depth: int, stack: tuple):
        """(params, keyword-only params, {param: suffixes of the paths it
        changes}, paths of globals it declares and changes, paths of free
        names it changes (module globals, or a closure's variables), script
        functions it calls).

        Recursion is a fixpoint: a call back into a function being
        summarised sees its summary so far (nothing, at first), and the
        function is summarised again until its summary stops growing.
        Summaries that depended on an unfinished one are not kept."""
        if fn is None:
            raise GiveUp("a function of the script is defined more than once")
        key = id(fn)
        if key in self._summaries:
            return self._summaries[key]
        if fn in stack:
            self._hits.append(key)
            return self._partial[key]
        self._partial[key] = _nothing(fn)
        mark = len(self._hits)
        try:
            while True:
                out = self._summarise(fn, depth, stack)
                if key not in self._hits[mark:] or _same(out, self._partial[key]):
                    break
                self._partial[key] = out
                del self._hits[mark:]
        finally:
            del self._partial[key]
        self._hits[mark:] = [k for k in self._hits[mark:] if k != key]
        if len(self._hits) == mark:  # it used no unfinished summary: final
            self._summaries[key] = out
        return out

    def _summarise(self, fn, depth, stack):
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        kwonly = [a.arg for a in fn.args.kwonlyargs]
        variadic = {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
        declared_global = {g for n in walk_scope(fn.body) if isinstance(n, ast.Global)
                           for g in n.names}
        eff = Effects()
        _collect(self, fn.body, eff, fn, depth, stack + (fn,))
        assigned = assigned_names(fn.body) | set(params) | set(kwonly) | variadic
        by_param: dict[str, list[str]] = {}
        globals_ = list(eff.globals)
        free = []  # names of the scope around the definition (module or closure)
        for p in eff.paths:
            r = root(p)
            if r in variadic:
                raise GiveUp(f"{fn.name}() changes {p}, passed through *{r}")
            if r in params or r in kwonly:
                by_param.setdefault(r, []).append(p[len(r):])
            elif r in declared_global:
                globals_.append(p)
            elif r not in assigned and self.state(p):
                free.append(p)
        return (params, kwonly, by_param, globals_, free, eff.calls | {fn.name})

    def state(self, path: str) -> bool:
        """Whether `path` may be training state: not a module, function or
        class of the script, but an attribute of a class of the script is
        (``Counter.calls += 1`` changes what every instance reads), and so
        are an attribute of a module of the project and a value imported
        from one (``cfg.STEP += 1``, ``STATS["n"] += 1``)."""
        r = root(path)
        if r not in self.not_state or (r in self.classes and path != r):
            return True
        found = self.imported(r) if r in self.imports else None
        if found is None:
            return False
        other, attr = found
        if attr is None:  # import cfg; cfg.STEP += 1
            return path != r
        # from cfg import STATS; STATS["n"] += 1 (a value, not a function or class)
        return attr in other.module_names and attr not in other.not_state

    def has_loop(self, fn, seen=()) -> bool:
        """Whether calling `fn` runs a loop (its body, or a function or method
        of the script it calls)."""
        if fn is None or fn in seen:
            return False
        owner = self.owner(fn)
        for n in walk_scope(fn.body):
            if isinstance(n, (ast.For, ast.While, ast.AsyncFor)):
                return True
            if isinstance(n, ast.Call):
                callee = owner.resolve(n, fn)
                if callee is not None and owner.has_loop(callee, seen + (fn,)):
                    return True
        return False


def _nothing(fn):
    """The summary of a function that changes nothing."""
    return ([a.arg for a in fn.args.posonlyargs + fn.args.args],
            [a.arg for a in fn.args.kwonlyargs], {}, [], [], {fn.name})


def _same(a, b) -> bool:
    """Two summaries of one function say the same."""
    def norm(s):
        return ({k: sorted(set(v)) for k, v in s[2].items()}, sorted(set(s[3])),
                sorted(set(s[4])), s[5])
    return norm(a) == norm(b)


_FORWARDS = ("forward", "__call__")


def _apply_call(script, call, eff, scope, depth, stack):
    """The effects of a call to a function of the script, on the caller's
    names (a method's first parameter is the receiver)."""
    fn = script.resolve(call, scope)
    if fn is None and not script.is_script_function(call, scope):
        unseen = script.unseen(call)
        if unseen is not None:
            raise GiveUp(f"line {call.lineno}: a call into {unseen}, a module the analysis "
                         "cannot find")
        # A call it cannot resolve may run the project's functions (a
        # trainer's callbacks, a model's forward).
        inside_forward = isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
            scope.name in _FORWARDS
        passed, inners = script.passed_methods(), script.inner_hooks()
        for candidate in script.may_run(call, scope):
            # A model's forward and __call__ where the block or a function it
            # calls (a trainer's train_epoch) calls a model, but not inside a
            # forward: there every layer's call would run every forward again
            # (a fixpoint over all of them, too slow to reach).
            if candidate.name not in _FORWARDS or depth == 0 or not inside_forward:
                sites = passed.get(id(candidate), (None, None))[1] if not (
                    isinstance(call.func, ast.Attribute) and call.func.attr == candidate.name) \
                    else None
                inner = inners.get(id(candidate))
                # (Not for a hook's or forward's own calls, output.mean():
                # the call of the model that runs them runs every hook.)
                hooked = not (inside_forward or id(scope) in passed or id(scope) in inners)
                if inner is not None and hooked:
                    _apply_inner(script, candidate, inner[1], call, eff, scope, depth, stack)
                elif sites and hooked:
                    _apply_hook(script, candidate, sites, call, eff, scope, depth, stack)
                if (inner is None and not sites) or candidate.name in _FORWARDS:
                    _apply_fn(script, candidate, call, eff, scope, depth, stack)
        return False
    _apply_fn(script, fn, call, eff, scope, depth, stack)
    if fn is not None and isinstance(call.func, ast.Attribute):
        for override in script.overrides(fn):  # a subclass's, on self
            _apply_fn(script, override, call, eff, scope, depth, stack)
    return True


def _apply_hook(script, fn, sites, call, eff, scope, depth, stack):
    """The effects of `fn`, a method handed over as a bound method at
    `sites` (``register_forward_hook(self._hook)``, an instance of a class
    with ``__call__``) or a function handed over through
    ``functools.partial``, run by `call` (``self.model(x)``, which runs
    the hook, or ``cb(stats, loss)``): what it changes of its self is the
    object the site took the method of, and of a parameter the argument the
    site bound it to, or else the argument of `call` in its place, all as
    the caller names them."""
    owner = script.owner(fn)
    params, _, by_param, globals_, free, calls = owner.summary(fn, depth + 1, stack)
    _hook_globals(script, owner, fn, globals_ + free, eff, scope)
    eff.calls |= calls
    method = id(fn) in owner.method_class and method_kind(fn) == "method"
    for site in sites if by_param else []:
        held = {}
        names = params
        if method and site.receiver is not None:
            names = params[1:]
            receiver = path_of(site.receiver)
            held[params[0]] = [] if receiver is None else \
                hooks.named_here(script, site.script, site.scope, receiver, scope)
        for param, arg in _bound(names, site.args, site.keywords):
            held[param] = [] if path_of(arg) is None else \
                hooks.named_here(script, site.script, site.scope, path_of(arg), scope)
        for param, arg in _bound(names[len(site.args):], call.args, call.keywords):
            if param not in held:
                held[param] = [p for p in (path_of(arg) or _result_of(arg),) if p]
        for param, suffixes in by_param.items():
            if param in held and not held[param]:
                cls = owner.method_class.get(id(fn))
                raise GiveUp(f"line {call.lineno} may run {cls.name + '.' if cls else ''}"
                             f"{fn.name}(), handed over at line "
                             f"{site.node.lineno} as a hook or callback, which changes "
                             f"{param}{suffixes[0]}, an object this code has no name for")
            _add_held(eff, held.get(param, []), suffixes)


def _bound(params, args, keywords):
    """(parameter, argument) pairs of a call's arguments, up to a splat."""
    for i, a in enumerate(args):
        if isinstance(a, ast.Starred):
            return
        if i < len(params):
            yield params[i], a
    for k in keywords:
        if k.arg is not None:
            yield k.arg, k.value


def _apply_inner(script, fn, enclosing, call, eff, scope, depth, stack):
    """The effects of a lambda or inner function `fn` of `enclosing`, handed
    over as a value (a hook, a callback, a closure a factory returns), run
    by `call`: what it changes of `enclosing`'s names, as the caller names
    them (the same names where the caller is `enclosing`, the instances of
    its class for a method's self, and for a parameter the argument of each
    call of `enclosing`, as the caller names that), and of its own
    parameters, the objects their defaults name (``store=self.acts``) or
    else the arguments of `call`."""
    owner = script.owner(fn)
    params, _, by_param, globals_, free, calls = owner.summary(fn, depth + 1, stack)
    eff.calls |= calls
    if isinstance(enclosing, ast.Module):
        _hook_globals(script, owner, fn, globals_ + free, eff, scope)
        local, enclosing_params = set(), []
    else:
        args = enclosing.args
        enclosing_params = [a.arg for a in args.posonlyargs + args.args]
        local = assigned_names(enclosing.body) | set(enclosing_params) | \
            {a.arg for a in args.kwonlyargs}
        _hook_globals(script, owner, fn, globals_ + [p for p in free if root(p) not in local],
                      eff, scope)
    defaults = dict(zip(params[::-1], fn.args.defaults[::-1]))
    defaults.update((a.arg, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)
                    if d is not None)
    for param, suffixes in by_param.items():
        default = defaults.get(param)
        # (store=self.acts.setdefault(name, []): a part of self.acts)
        named = None if default is None else path_of(default) or _result_of(default)
        if named is not None:
            holders = hooks.named_here(script, owner, enclosing, named, scope)
            suffixes = suffixes if path_of(default) is not None else [""]
            if not holders:
                raise GiveUp(f"line {call.lineno} may run a function defined at line "
                             f"{fn.lineno} and handed over as a value, which changes "
                             f"{param}{suffixes[0]}, an object this code has no name for")
        else:
            args = [a for p, a in _bound(params, call.args, call.keywords) if p == param]
            holders = [p for a in args for p in (path_of(a) or _result_of(a),) if p]
            if args and not holders:
                raise GiveUp(f"line {call.lineno} may run a function defined at line "
                             f"{fn.lineno} and handed over as a value, which changes "
                             f"{param}{suffixes[0]}, an argument this code has no name for")
        _add_held(eff, holders, suffixes)
    for p in free:
        r = root(p)
        if r not in local:
            continue
        holders = hooks.named_here(script, owner, enclosing, r, scope)
        if not holders and r in enclosing_params and r != hooks.first_param(owner, enclosing):
            kind = method_kind(enclosing) if id(enclosing) in owner.method_class else None
            names = enclosing_params[1:] if kind in ("method", "classmethod") else \
                enclosing_params
            for site_script, site_scope, c in script.call_sites(enclosing):
                for arg in (a for q, a in _bound(names, c.args, c.keywords) if q == r):
                    if path_of(arg) is not None:
                        holders += hooks.named_here(script, site_script, site_scope,
                                                    path_of(arg), scope)
        if not holders:
            raise GiveUp(f"line {call.lineno} may run a function defined at line {fn.lineno} "
                         f"in {enclosing.name}() and handed over as a value, which changes "
                         f"{p}, a name of {enclosing.name}() this code cannot name")
        _add_held(eff, holders, [p[len(r):]])


def _add_held(eff, holders, suffixes):
    for holder, suffix in ((h, x) for h in holders for x in suffixes):
        if isinstance(holder, str):
            eff.add(_capped(holder + suffix), 2)
        elif _capped(holder[0] + suffix) not in eff.globals:
            eff.globals.append(_capped(holder[0] + suffix))


def _hook_globals(script, owner, fn, paths, eff, scope):
    """A hook's changes of module globals: the block's own names where it is
    at the module level of the hook's file, else globals it changes."""
    if not paths:
        return
    if owner is not script:
        raise GiveUp(f"{fn.name}() of {os.path.basename(owner.path or '?')} changes the "
                     f"globals of its module ({', '.join(paths[:3])})")
    for g in paths:
        if isinstance(scope, ast.Module):
            eff.add(_capped(g), 2)
        elif g not in eff.globals:
            eff.globals.append(g)


def _apply_fn(script, fn, call, eff, scope, depth, stack):
    """The effects of `fn`, run by `call`, on the caller's names."""
    owner = script.owner(fn) if fn is not None else script
    params, kwonly, by_param, globals_, free, calls = owner.summary(fn, depth + 1, stack)
    if owner is not script and (globals_ or free):
        raise GiveUp(f"{fn.name}() of {os.path.basename(owner.path or '?')} changes the "
                     f"globals of its module ({', '.join((globals_ + free)[:3])})")
    eff.calls |= calls
    local = isinstance(call.func, ast.Name) and call.func.id in script.defs(scope)
    for g in globals_ + ([] if local else free):
        if g not in eff.globals:
            eff.globals.append(g)
    for p in free if local else []:  # a closure: the free names are the caller's
        eff.add(p, 2)
    if not by_param:
        return
    bound: dict[str, ast.AST] = {}
    splat = False
    kind = method_kind(fn) if fn is not None and id(fn) in owner.method_class else None
    # The object a method runs on: obj's in obj.name(...); the object called
    # in net(x) and self.model(x) (its forward or __call__).
    called = kind is not None and fn.name in ("forward", "__call__") and not (
        isinstance(call.func, ast.Attribute) and call.func.attr == fn.name)
    if (isinstance(call.func, ast.Attribute) or called) and params and \
            (fn is None or kind is not None):
        # (not engine.train(...), nor a staticmethod)
        receiver = call.func if called else call.func.value  # self
        if kind == "classmethod":  # cls: the class, not the instance it is called on
            receiver = _class_expr(script, receiver, scope, fn)
        if kind != "staticmethod":
            bound[params[0]] = receiver
            params = params[1:]
    for i, a in enumerate(call.args):
        if isinstance(a, ast.Starred):
            splat = True
            break
        if i < len(params):
            bound[params[i]] = a
    for k in call.keywords:
        if k.arg is None:
            splat = True
        else:
            bound[k.arg] = k.value
    for param, suffixes in by_param.items():
        arg = bound.get(param)
        if arg is None:
            if splat:
                raise GiveUp(f"{fn.name}() changes its argument {param!r}, "
                             "passed here through *args or **kwargs")
            continue  # the default value: not the caller's
        base = path_of(arg)
        if base is None:
            continue  # a temporary: the change is not visible to the caller
        whole = isinstance(arg, ast.Subscript) and not isinstance(arg.slice, ast.Constant)
        for suffix in suffixes:
            eff.add(base if whole else _capped(base + suffix), 2)


#: The most steps a path a call's effects make may have past its root; a
#: longer one stands for its prefix (what holds it).  A method applied to
#: its own attribute (self.opt.step() taken for a Trainer.step that changes
#: self.opt) would otherwise make self.opt.opt.opt... and never converge.
MAX_STEPS = 6
_STEP = re.compile(r"\.[A-Za-z_]\w*|\[[^\[\]]*\]")


def _capped(path: str) -> str:
    r = root(path)
    steps = _STEP.findall(path[len(r):])
    return r + "".join(steps[:MAX_STEPS]) if len(steps) > MAX_STEPS else path


def _class_expr(script, receiver, scope, fn):
    """The class a classmethod is called on, as the caller names it:
    ``Counter.bump()``'s Counter; ``meter.bump()``'s class, when it is the
    script's own (else the analysis gives up: no name of the caller's holds
    it)."""
    if isinstance(receiver, ast.Name):
        if script.class_of(receiver.id) is not None:
            return receiver
        of = script.types(scope).get(receiver.id)
        if of is not None and of[0] is script:
            return ast.Name(id=of[1], ctx=ast.Load())
    raise GiveUp(f"{fn.name}(), a classmethod, changes its class, called on an object "
                 "whose class the analysis cannot name")


def _collect(script, stmts, eff, scope, depth, stack):
    """Apply the rules to every statement under `stmts`."""
    for s in stmts:
        for n in walk_scope([s]):
            if isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await)) and depth == 0:
                raise GiveUp(f"line {n.lineno}: the block {type(n).__name__.lower()}s")
            if isinstance(n, ast.Nonlocal):
                raise GiveUp(f"line {n.lineno}: nonlocal")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                    n.func.id in OPAQUE:
                raise GiveUp(f"line {n.lineno}: {n.func.id}()")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr.startswith("register_") and "hook" in n.func.attr and \
                    (depth == 0 or n.func.attr != "register_hook"):
                # What a hook is registered on is in no checkpoint: a block
                # passed over by restoring it would leave the hook out.  (A
                # tensor's hook that a forward registers on its activation
                # goes with the activation.)
                raise GiveUp(f"line {n.lineno}: {n.func.attr}(), a hook no checkpoint holds")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr == "remove" and not n.args and not n.keywords:
                # handle.remove(): a hook's handle (what it removes, no
                # checkpoint holds; a list's remove takes the item)
                raise GiveUp(f"line {n.lineno}: {path_of(n.func) or 'remove'}(), a hook "
                             "removed, which no checkpoint holds")
            if isinstance(n, ast.Name):
                eff.reads.add(n.id)
    for s in simple_statements(stmts):
        handled = set()
        _rule(script, s, eff, scope, depth, stack, handled)
        _comprehensions(script, s, eff)
        # Calls to the script's own functions anywhere in the statement.
        for n in walk_scope(own_nodes(s)):
            if isinstance(n, ast.Call) and id(n) not in handled:
                _apply_call(script, n, eff, scope, depth, stack)
    _through_aliases(script, stmts, eff)


def _through_aliases(script, stmts, eff):
    """What the statements change in place through a name bound to an
    object reached by a path (``s = STATS`` then ``s["batches"] += 1``;
    ``h = self.history`` then ``h.append(x)``) counts as changed under that
    path too: dropping the name with the block's locals must not drop it."""
    aliases: dict[str, set] = {}  # name -> {(path, whether it names a whole container)}
    in_place = set()  # names changed by x op= y (a list's += extends it), receivers,
    # and containers of an item or attribute set (s[key] = v)

    def bind(target, value):
        if isinstance(target, ast.Name):
            for p, whole in _named(value):
                aliases.setdefault(target.id, set()).add((p, whole))
        elif isinstance(target, (ast.Tuple, ast.List)) and \
                isinstance(value, (ast.Tuple, ast.List)) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                bind(t, v)

    for s in simple_statements(stmts):
        if isinstance(s, ast.Assign):
            for t in s.targets:  # (s = t = STATS: each)
                bind(t, s.value)
        elif isinstance(s, (ast.For, ast.AsyncFor)) and isinstance(s.iter, (ast.Tuple, ast.List)):
            for elt in s.iter.elts:  # for d in (STATS, CFG): d[...] += 1
                bind(s.target, elt)
        for n in walk_scope(own_nodes(s)):
            if isinstance(n, ast.NamedExpr):
                bind(n.target, n.value)
        targets = s.targets if isinstance(s, ast.Assign) else \
            [s.target] if isinstance(s, (ast.AugAssign, ast.AnnAssign)) else []
        for t in (tt for t in targets for tt in single_targets(t)):
            if isinstance(t, ast.Name) and isinstance(s, ast.AugAssign):
                in_place.add(t.id)
            elif isinstance(t, (ast.Attribute, ast.Subscript)) and stops(t):
                in_place.add(root(path_of(t)))  # s[key] = v: s changes, whole
        in_place |= {n.func.value.id for n in walk_scope(own_nodes(s))
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and isinstance(n.func.value, ast.Name)}

    def through(p, depth=0):
        r = root(p)
        if r not in aliases or depth > 8:
            return
        for a, whole in aliases[r]:
            q = a if whole else a + p[len(r):]  # an item by a variable: its container
            yield q
            yield from through(q, depth + 1)

    for p in list(eff.paths):
        r, rule = root(p), eff.rules[p]
        if p != r or r in in_place:
            for q in through(p):
                if q != p and script.state(q):
                    eff.add(q, rule)


def _named(value) -> list:
    """(path, whether it names a whole container) of each object an
    assigned value may be: a path, or either branch of ``a if c else b``."""
    if isinstance(value, ast.IfExp):
        return _named(value.body) + _named(value.orelse)
    if isinstance(value, ast.NamedExpr):
        return _named(value.value)
    p = path_of(value)
    return [(p, stops(value))] if p is not None else []


def _drawn_from(it) -> list[str]:
    """The paths of the objects a loop over `it` draws from: the receivers
    in it (``model.parameters()``, ``opts.values()``), or the container it
    names (``opts``)."""
    out = []
    for n in ast.walk(it):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            out.append(path_of(n.func.value))
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            out.append(path_of(n.value))
    if not out and isinstance(it, (ast.Name, ast.Attribute, ast.Subscript)):
        out.append(path_of(it))
    return [p for p in out if p is not None]


def _comprehensions(script, s, eff):
    """A comprehension whose element changes its variable in place
    (``[o.step() for o in opts]``, ``[m.train() for m in models.values()]``):
    the objects it draws from change, as a for loop's do (rule 1).  The
    variable itself is the comprehension's own (dropped, block_effects)."""
    for n in walk_scope(own_nodes(s)):
        if not isinstance(n, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        parts = [n.key, n.value] if isinstance(n, ast.DictComp) else [n.elt]
        parts += [c for g in n.generators for c in g.ifs]
        changed = set()  # the comprehension's names whose objects it changes
        for g in reversed(n.generators):  # an inner generator draws from an outer's name
            names = {t.id for t in ast.walk(g.target) if isinstance(t, ast.Name)}
            if not (names & changed or _mutates(parts, names, script)):
                continue
            for obj in _drawn_from(g.iter):
                changed.add(root(obj))
                if script.state(obj):
                    eff.add(obj, 1)


#: Methods that read what they are called on (a tensor's, a container's, a
#: module's), unless a class of the project has a method of that name: a
#: loop or comprehension calling only these on its variable changes nothing
#: it draws from (a probe's sum(p.grad.norm() for p in model.parameters())).
READS = frozenset({
    "norm", "sum", "mean", "std", "var", "abs", "max", "min", "amax", "amin", "item",
    "tolist", "numpy", "numel", "nelement", "dim", "size", "detach", "clone", "cpu",
    "float", "double", "half", "to", "pow", "sqrt", "square", "flatten", "view",
    "reshape", "isnan", "isinf", "isfinite", "all", "any", "count_nonzero", "get", "keys",
    "values", "items", "copy", "count", "index", "parameters", "named_parameters",
    "buffers", "named_buffers", "modules", "named_modules", "children", "state_dict"})


def _reads_only(script, call) -> bool:
    """Whether `call` (obj.name(...)) is of a method that only reads."""
    name = call.func.attr
    return name in READS and not script.has_method(name)


def _mutates(stmts, names, script=None) -> bool:
    """Whether `stmts` change an object bound to one of `names` in place
    (a call of a method that only reads, READS, does not, where `script`
    says which methods its project has)."""
    for n in walk_scope(stmts):
        target = None
        if isinstance(n, ast.AugAssign):
            target = n.target
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for tt in single_targets(t):
                    if isinstance(tt, (ast.Attribute, ast.Subscript)):
                        target = tt
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                not (script is not None and _reads_only(script, n)):
            target = n.func.value
        p = path_of(target) if target is not None else None
        if p is not None and root(p) in names:
            return True
    return False


def read_first(stmts) -> set[str]:
    """Names the statements read before (in source order) they assign them:
    their values come from before the block, or from its previous iteration."""
    stored, first = set(), set()
    for s in simple_statements(stmts):
        own = walk_scope(own_nodes(s))
        names = [n for n in own if isinstance(n, ast.Name)]
        for n in names:
            if isinstance(n.ctx, ast.Load) and n.id not in stored:
                first.add(n.id)
        if isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) and \
                s.target.id not in stored:
            first.add(s.target.id)
        stored |= {n.id for n in names if isinstance(n.ctx, ast.Store)}
    return first


def _add_targets(eff, targets, rule, script):
    for t in targets:
        for tt in single_targets(t):
            p = path_of(tt)
            if p is not None and script.state(p):
                eff.add(p, rule)
                if not (isinstance(tt, ast.Subscript) and p == path_of(tt.value)):
                    eff.assigned.add(p)  # rebound, not changed in place


def _rule(script, s, eff, scope, depth, stack, handled):
    for attr in ("value", "iter", "test", "items"):  # the statement's own expressions
        advanced(script, getattr(s, attr, None), eff)
    iterated(script, s, eff)
    value, targets = None, None
    if isinstance(s, ast.Assign):
        value, targets = s.value, s.targets
    elif isinstance(s, ast.AugAssign):
        # x += y changes x in place when it can (a tensor, a list): restored
        # in place; an int or a float comes back by rebinding anyway.
        p = path_of(s.target)
        known = p in eff.rules
        value = s.value
        if not known and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                and script.resolve(value, scope) is None:
            obj = path_of(value.func.value)  # rule 1: x += obj.method()
            if obj is not None and script.state(obj):
                eff.add(obj, 1)
        if p is not None and script.state(p):
            eff.add(p, 0 if known else 1 if isinstance(value, ast.Call) and isinstance(
                value.func, ast.Attribute) else 2 if isinstance(value, ast.Call) else 3)
        if isinstance(value, ast.Call) and script.is_script_function(value, scope):
            handled.add(id(value))
            _apply_call(script, value, eff, scope, depth, stack)
        return
    elif isinstance(s, ast.AnnAssign) and s.value is not None:
        value, targets = s.value, [s.target]
    elif isinstance(s, (ast.For, ast.AsyncFor)):
        # The loop variable is an assignment (rule 3).  When the body changes
        # what it refers to (for p in model.parameters(): p -= ...), the
        # objects it is drawn from change: their receivers count (as rule 1).
        names = {n.id for n in ast.walk(s.target) if isinstance(n, ast.Name)}
        if isinstance(s.iter, ast.Name) and script.state(s.iter.id) and (
                _mutates(s.body, names, script) or any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and
                    n.func.id in names for n in walk_scope(s.body))):
            eff.add(s.iter.id, 1)  # for cb in callbacks: cb(loss): the list, and its items
        elif _mutates(s.body, names, script):
            for n in ast.walk(s.iter):
                obj = None
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    obj = path_of(n.func.value)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                    obj = path_of(n.value)
                if obj is not None and script.state(obj):
                    eff.add(obj, 1)
        value, targets = None, [s.target]
    elif isinstance(s, (ast.With, ast.AsyncWith)):
        targets = [i.optional_vars for i in s.items if i.optional_vars is not None]
    if targets is not None:
        arg = _changed_argument(value) if isinstance(value, ast.Call) else None
        if arg is not None and script.resolve(value, scope) is None and script.state(arg):
            eff.add(arg, 4)  # pri, b = heapq.heappop(queue): queue, in place
        paths = [path_of(tt) for t in targets for tt in single_targets(t)]
        if any(p is not None and p in eff.rules for p in paths):
            _add_targets(eff, targets, 0, script)  # rule 0
            return
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and \
                script.resolve(value, scope) is None:
            obj = path_of(value.func.value)  # rule 1
            if obj is not None and script.state(obj):
                eff.add(obj, 1)
            _add_targets(eff, targets, 1, script)
            return
        if isinstance(value, ast.Call):  # rule 2
            _add_targets(eff, targets, 2, script)
            if script.is_script_function(value, scope):
                handled.add(id(value))
                _apply_call(script, value, eff, scope, depth, stack)
            return
        _add_targets(eff, targets, 3, script)  # rule 3
        return
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
        call = s.value
        arg = _changed_argument(call)
        if arg is not None and script.resolve(call, scope) is None:
            if script.state(arg):  # random.shuffle(order): the argument, in place
                eff.add(arg, 4)
            if not isinstance(call.func, ast.Attribute):
                handled.add(id(call))
                return
        if isinstance(call.func, ast.Attribute) and script.resolve(call, scope) is None:  # rule 4
            obj = path_of(call.func.value) or _result_of(call.func.value)
            if obj is not None and script.state(obj):
                eff.add(obj, 4)
            else:
                eff.unknown.append(s.lineno)
            return
        handled.add(id(call))  # rule 5
        if not _apply_call(script, call, eff, scope, depth, stack):
            eff.unknown.append(s.lineno)


def _result_of(value) -> str | None:
    """The object that a method's result, changed in place, may be part of:
    ``store``, in ``store.setdefault(k, []).append(v)``."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        value = value.func.value
        if path_of(value) is not None:
            return path_of(value)
    return None


# Library functions that change their first argument in place, by name (and
# the module that must be their receiver, or None for any receiver): a list
# shuffled by random.shuffle, numpy's shuffle or a Generator's; a heap; a
# sorted list that bisect inserts into.
_IN_PLACE = {"shuffle": None, "heappush": "heapq", "heappop": "heapq", "heapify": "heapq",
             "heapreplace": "heapq", "heappushpop": "heapq", "insort": "bisect",
             "insort_left": "bisect", "insort_right": "bisect"}


def _changed_argument(call):
    """The path of the argument a library call changes in place
    (``random.shuffle(order)``: ``order``), or None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else (
        func.id if isinstance(func, ast.Name) else None)
    if name not in _IN_PLACE or not call.args:
        return None
    module = _IN_PLACE[name]
    if module is not None and isinstance(func, ast.Attribute) and \
            (path_of(func.value) or "").rsplit(".", 1)[-1] != module:
        return None
    return path_of(call.args[0])


def block_effects(script: Script, block: list, scope) -> Effects:
    """The changeset of the statements `block`, nested in `scope` (the
    module, or the function holding them).  Raises GiveUp."""
    eff = Effects()
    _collect(script, block, eff, scope, 0, ())
    inside = assigned_names(block) - read_first(block)
    block_ids = {id(n) for b in block for n in ast.walk(b)}
    outside = set()  # names read in the scope outside the block
    for sub in walk_scope(scope.body):
        if id(sub) in block_ids:
            continue
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            outside.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            outside |= free_names(sub)
    declared = {g for n in ast.walk(scope) if isinstance(n, (ast.Global, ast.Nonlocal))
                for g in n.names} if not isinstance(scope, ast.Module) else set()
    module_level = isinstance(scope, ast.Module)
    # A comprehension's own variable (p in sum(p.grad.norm() for p in ...)),
    # where the block uses that name nowhere else.
    own = comprehension_names(block)

    def scoped(p):
        r = root(p)
        if r in own:
            return True
        return (r in inside and r not in outside and r not in declared
                and not (module_level and r in script.global_reads))

    kept = []
    for p in eff.paths:
        (eff.dropped if scoped(p) else kept).append(p)
    eff.iterated = {p for p in eff.iterated if not scoped(p) and p not in eff.rules}
    # A path under another kept path is captured with it.
    eff.paths = [p for p in kept if not any(
        q != p and (p.startswith(q + ".") or p.startswith(q + "[")) for q in kept)]
    eff.globals = [g for g in eff.globals if not any(
        q != g and (g.startswith(q + ".") or g.startswith(q + "[")) for q in eff.globals)]
    return eff


class _Returned(ast.NodeTransformer):
    """A function's ``return X`` as the statement ``X`` (a block may not
    return)."""

    def visit_Return(self, node):
        return ast.copy_location(ast.Expr(node.value) if node.value else ast.Pass(), node)


def _library_called(tree: ast.Module) -> list:
    """The functions of the script that a library it hands objects to may
    call while it trains: the methods of its classes (a callback's hooks, a
    Trainer subclass's compute_loss, a model's forward), the functions it
    passes as values (``compute_metrics=compute_metrics``), and the
    script's functions these call, transitively.  Not a function the script
    only calls itself (``load()`` filling a dataset before training)."""
    defs = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.setdefault(n.name, []).append(n)
    methods = [m for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for m in c.body
               if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    called_funcs = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    passed = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Load) and id(n) not in called_funcs and n.id in defs}
    todo = methods + [f for name in passed for f in defs[name]]
    seen: dict = {}
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        todo += [f for name in called_names(fn.body) for f in defs.get(name, [])]
    return list(seen.values())


def globals_changed(tree: ast.Module) -> set[str]:
    """The module-level names of the script that code a library calls while
    it trains (`_library_called`) changes, set (``global n``) or in place
    (``SEEN["batches"] += 1``): what a callback or a ``compute_loss`` may
    change outside the objects it is handed."""
    script = Script(tree)
    out = set()
    for fn in _library_called(tree):
        try:  # its body as a block (what it returns, evaluated)
            eff = block_effects(script, _Returned().visit(copy.deepcopy(fn)).body, fn)
        except GiveUp:
            continue
        declared = {g for n in ast.walk(fn) if isinstance(n, ast.Global) for g in n.names}
        args = fn.args
        local = (assigned_names(fn.body) - declared) | {
            a.arg for a in args.posonlyargs + args.args + args.kwonlyargs
            + [x for x in (args.vararg, args.kwarg) if x is not None]}
        for p in eff.globals + eff.paths:
            r = root(p)
            if r in script.module_names and script.state(p) and r not in local:
                out.add(r)
    return out
