"""Code the script hands over to run later (hooks and callbacks), and how a
block names what it changes: the part of the side-effect analysis
(analysis.py) that follows ``layer.register_forward_hook(self._record)``,
``callbacks=[meter.update]``, ``functools.partial(record, acts, "fc1")``,
a lambda or a closure a factory returns into the unresolved calls that may
run them (``self.model(x)``).  Pure functions of the project's parsed
files (calls.Calls: `handed_over`, `inner_functions` and `calls_by_callee`
are what it keeps of them), and of how one scope names an object another
scope names (`named_here`)."""
from __future__ import annotations

import ast
from typing import NamedTuple

from .syntax import assigned_names, method_kind, path_of, root, walk_scope

__all__ = ["Site", "handed_over", "inner_functions", "calls_by_callee", "named_here",
           "first_param"]


class Site(NamedTuple):
    """Where code hands a method or function over to run later: in `scope`
    of `script`, at `node`; `receiver` the expression of the object whose
    method it is (None for a function), and the arguments a
    ``functools.partial`` binds first (`args`, `keywords`)."""
    script: object
    scope: ast.AST
    node: ast.AST
    receiver: ast.AST | None
    args: list
    keywords: list


def handed_over(scripts) -> dict:
    """{id(method): (method, [Site])} for each method of the project's
    classes (of `scripts`) that some code hands over as a bound method, to
    run later as a hook or callback (``layer.register_forward_hook(
    self._hook)``, ``callbacks=[trainer.on_step]``, ``partial(self._hook,
    name)``, an instance of a class with ``__call__``), and each
    module-level function handed over through ``functools.partial``."""
    methods: dict = {}
    callable_classes: dict = {}
    for s in scripts:
        for c in s.classes.values():
            for m in c.body:
                if not isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                        any(_attribute_like(d) for d in m.decorator_list):
                    continue
                if m.name == "__call__":
                    callable_classes.setdefault(c.name, []).append(m)
                elif m.name != "forward":
                    methods.setdefault(m.name, []).append(m)
    out: dict = {}
    for s in scripts:
        called = {id(n.func) for n in ast.walk(s.tree) if isinstance(n, ast.Call)}
        for scope in [s.tree] + [n for n in ast.walk(s.tree) if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]:
            nodes = list(walk_scope([scope.body] if isinstance(scope, ast.Lambda)
                                    else scope.body))
            partials = {id(n.args[0]): n for n in nodes if isinstance(n, ast.Call) and n.args
                        and (path_of(n.func) or "").split(".")[-1] == "partial"}
            # (self.correct = 0 reads self, but hands nothing over)
            reached = {id(n.value) for n in nodes
                       if isinstance(n, (ast.Attribute, ast.Subscript))}
            types = s.types(scope) if not isinstance(scope, ast.Lambda) else {}
            for n in nodes:
                if id(n) in called or not isinstance(getattr(n, "ctx", None), ast.Load):
                    continue
                found, receiver = [], None
                if isinstance(n, ast.Attribute) and n.attr in methods:
                    found, receiver = methods[n.attr], n.value
                elif isinstance(n, ast.Name) and n.id in types and id(n) not in reached:
                    found, receiver = callable_classes.get(types[n.id][1], []), n
                elif isinstance(n, ast.Name) and id(n) in partials and \
                        s.functions.get(n.id) is not None:
                    found = [s.functions[n.id]]
                part = partials.get(id(n))
                for m in found:
                    out.setdefault(id(m), (m, []))[1].append(Site(
                        s, scope, n, receiver, part.args[1:] if part else [],
                        part.keywords if part else []))
    return out


#: Builtins that call the function they are given, or consume the iterator
#: they are given, before they return (and keep neither): a lambda handed
#: to one, or to a map or filter handed to one, runs there, never later.
_CONSUMING = {"sorted", "min", "max", "sum", "any", "all", "list", "tuple", "set", "dict"}


def _consuming(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        node.func.id in _CONSUMING


def _arguments(call) -> list:
    return list(call.args) + [k.value for k in call.keywords]


def inner_functions(scripts, modules) -> dict:
    """{id(fn): (fn, enclosing)} for each lambda, and each function defined
    in another, that the code hands over as a value to run later
    (``register_forward_hook(lambda m, i, o: acts.append(...))``, ``return
    hook``) rather than only calling it where it is defined: `fn` the
    definition (one made once for a lambda, and registered with `modules`
    as its file's) and `enclosing` the function, or module, it is in."""
    out: dict = {}
    for s in scripts:
        for enclosing in [s.tree] + [n for n in ast.walk(s.tree) if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            nodes = list(walk_scope(enclosing.body))
            called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
            valued = {n.id for n in nodes if isinstance(n, ast.Name) and
                      isinstance(n.ctx, ast.Load) and id(n) not in called}
            at_once = {id(a) for n in nodes if _consuming(n) for a in _arguments(n)}
            at_once |= {id(a) for n in nodes if id(n) in at_once and isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Name) and n.func.id in ("map", "filter")
                        for a in _arguments(n)}  # list(map(lambda p: ..., params))
            for n in nodes:
                if isinstance(n, ast.Lambda) and id(n) not in at_once:
                    fn = _as_function(n)
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        enclosing is not s.tree and n.name in valued:
                    fn = n
                else:
                    continue
                if modules is not None:
                    modules.owners[id(fn)] = s
                out[id(fn)] = (fn, enclosing)
    return out


def calls_by_callee(scripts) -> dict:
    """{id(function): [(Script, scope, call)]}: each call in the project
    that runs a function of it by its name (``recorder(self.acts, "h")``)."""
    out: dict = {}
    for s in scripts:
        for scope in [s.tree] + [n for n in ast.walk(s.tree) if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for n in walk_scope(scope.body):
                if isinstance(n, ast.Call):
                    callee = s.resolve(n, scope)
                    if callee is not None:
                        out.setdefault(id(callee), []).append((s, scope, n))
    return out


def named_here(script, site_script, site_scope, path, scope) -> list:
    """How `scope` names what `path` names in `site_scope`: the same path in
    the same scope; a method's self as the instances of its class (or of
    classes derived one from the other) that `scope` names (its own self
    among them); a module global as itself (``(path,)`` where `scope` is a
    function: a global it changes).  Nothing for a loop's or comprehension's
    variable (``for mon in monitors: layer.register_forward_hook(
    mon.record)``): it names one object of many."""
    r = root(path)
    if r in _loop_targets(site_scope):
        return []
    if site_scope is scope:
        return [path]
    if r == first_param(site_script, site_scope):
        cls = site_script.method_class[id(site_scope)].name
        here = [name + path[len(r):] for name in _instances(script, scope, {cls})]
        if not here and not isinstance(scope, ast.Module):  # monitor = Monitor(model)
            here = [(name + path[len(r):],) for name in _instances(script, script.tree, {cls})
                    if name not in assigned_names(scope.body)]
        return here
    if isinstance(site_scope, ast.Module) and site_script is script and \
            r in script.module_names:
        return [path] if isinstance(scope, ast.Module) else [(path,)]
    return []


def _loop_targets(scope) -> set:
    """The names `scope`'s for loops and comprehensions bind."""
    body = [scope.body] if isinstance(scope, ast.Lambda) else scope.body
    out = set()
    for n in walk_scope(body):
        if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            out |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
    return out


def first_param(script, scope) -> str | None:
    """The name of a method's self, where `scope` is a method (not a static
    or class method)."""
    args = getattr(scope, "args", None)
    if id(scope) not in script.method_class or args is None or \
            not (args.posonlyargs + args.args) or method_kind(scope) != "method":
        return None
    return (args.posonlyargs + args.args)[0].arg


def _instances(script, scope, classes: set) -> list:
    """The names `scope` binds to instances of the given classes, or of
    classes derived one from another with them (a method's self among them)."""
    return [name for name, (_, of) in script.types(scope).items()
            if of in classes or any(script.derives(of, c) or script.derives(c, of)
                                    for c in classes)]


def _attribute_like(decorator) -> bool:
    """A decorator that makes a method read as an attribute (``@property``,
    ``@functools.cached_property``, ``@x.setter``), never handed over."""
    name = decorator.id if isinstance(decorator, ast.Name) else \
        decorator.attr if isinstance(decorator, ast.Attribute) else None
    return name in ("property", "cached_property", "setter", "getter", "deleter")


def _as_function(lam: ast.Lambda) -> ast.FunctionDef:
    """A function definition that stands for a lambda (its body an expression
    statement: what it changes, not what it gives)."""
    body = [ast.copy_location(ast.Expr(value=lam.body), lam.body)]
    fn = ast.FunctionDef(name="<lambda>", args=lam.args, body=body, decorator_list=[],
                         returns=None, type_comment=None, type_params=[])
    return ast.copy_location(fn, lam)
