"""Walking Python source: the AST vocabulary shared by flor's analyses.

- statement bodies: `BODIES`, `bodies`, `is_compound`, `header`, `own_nodes`,
  `simple_statements`;
- scopes: `walk_scope` (not entering nested functions, classes, lambdas),
  `assigned_names`, `loaded_names`, `free_names`;
- paths, the objects statements read and change: `path_of`, `root`, `targets`;
- functions and calls: `method_kind`, `functions`, `methods`, `called_names`, `call_graph`
  and `callers_closure`, the fixpoint of "changed functions and everything
  that calls them".
"""
from __future__ import annotations

import ast
import copy

__all__ = ["BODIES", "bodies", "is_compound", "header", "own_nodes", "simple_statements",
           "walk_scope", "assigned_names", "loaded_names", "free_names", "path_of", "root",
           "targets", "method_kind", "functions", "methods", "called_names", "call_graph", "reaches",
           "callers_closure", "simple_name"]

# The fields of a compound statement that hold statements (or except
# handlers and match cases, which hold statements), in source order.
BODIES = ("body", "handlers", "orelse", "finalbody", "cases")


def bodies(stmt):
    """(field, list) of each non-empty body of a compound statement, in
    source order; handlers and cases are listed as they are."""
    out = []
    for name in BODIES:
        sub = getattr(stmt, name, None)
        if isinstance(sub, list) and sub and isinstance(
                sub[0], (ast.stmt, ast.excepthandler, ast.match_case)):
            out.append((name, sub))
    return out


def is_compound(stmt) -> bool:
    return bool(bodies(stmt))


def header(stmt):
    """A copy of a compound statement without its bodies."""
    head = copy.copy(stmt)
    for name in BODIES:
        if hasattr(head, name):
            setattr(head, name, [])
    return head


def own_nodes(stmt) -> list:
    """A statement's own expressions: a compound statement's header, not its body."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    out = []
    for name, value in ast.iter_fields(stmt):
        if name in BODIES:
            continue
        out.extend(value if isinstance(value, list) else [value])
    return [n for n in out if isinstance(n, ast.AST)]


def simple_statements(stmts):
    """The statements under `stmts`, in order, entering compound ones (each
    yielded first, for its header: for targets, with-as, except-as) but not
    functions or classes."""
    for s in stmts:
        yield s
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for _, sub in bodies(s):
            inner = []
            for x in sub:
                inner.extend(x.body if isinstance(x, (ast.ExceptHandler, ast.match_case))
                             else [x])
            yield from simple_statements(inner)


def walk_scope(nodes):
    """Every node under `nodes`, not entering nested functions, classes or lambdas."""
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def assigned_names(nodes) -> set[str]:
    out = set()
    for n in walk_scope(nodes):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                out.add((a.asname or a.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
    return out


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def comprehension_names(nodes) -> set[str]:
    """Names that appear under `nodes` only inside comprehensions that bind
    them (``p`` in ``sum(p.norm() for p in ps)``): there each is the
    comprehension's own, never a name of the scope around it."""
    own = set()  # ids of the Name nodes a comprehension around them binds
    for n in walk_scope(nodes):
        if isinstance(n, _COMPREHENSIONS):
            bound = {t.id for g in n.generators for t in ast.walk(g.target)
                     if isinstance(t, ast.Name)}
            own |= {id(x) for x in ast.walk(n) if isinstance(x, ast.Name) and x.id in bound}
    names = [x for x in walk_scope(nodes) if isinstance(x, ast.Name)]
    return {x.id for x in names if id(x) in own} - {x.id for x in names if id(x) not in own}


def loaded_names(nodes) -> set[str]:
    """Names read under `nodes`, nested functions included."""
    out = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                out.add(n.id)
    return out


def free_names(fn) -> set[str]:
    """Names a function (or lambda) reads that are not its own locals."""
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    a = fn.args
    params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    params |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    declared = {g for m in walk_scope(body) if isinstance(m, ast.Global) for g in m.names}
    return loaded_names(body) - ((assigned_names(body) | params) - declared)


def path_of(node) -> str | None:
    """``a``, ``a.b``, ``a["k"]``, ``a[0].b``; a non-constant subscript stops
    the path at its container, and what follows it too (``hist[ep]["loss"]``
    and ``slots[j].count`` are ``hist`` and ``slots``).  None for anything
    else."""
    found = _path(node)
    return found[0] if found is not None else None


def stops(node) -> bool:
    """Whether the path of `node` stopped at a container (a subscript by a
    variable on the way): it names the container, not the item."""
    found = _path(node)
    return found is not None and found[1]


def _path(node):
    """(path, whether it stopped at a container) or None."""
    if isinstance(node, ast.Name):
        return node.id, False
    if isinstance(node, (ast.Starred, ast.NamedExpr)):  # ((s := STATS)["n"]: STATS's)
        return _path(node.value)
    if not isinstance(node, (ast.Attribute, ast.Subscript)):
        return None
    base = _path(node.value)
    if base is None or base[1]:
        return base
    if isinstance(node, ast.Attribute):
        return f"{base[0]}.{node.attr}", False
    if isinstance(node.slice, ast.Constant) and isinstance(
            node.slice.value, (int, str)) and not isinstance(node.slice.value, bool):
        return f"{base[0]}[{node.slice.value!r}]", False
    return base[0], True


def method_kind(fn) -> str:
    """A method's kind by its decorators: "classmethod", "staticmethod" or
    "method"."""
    names = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
    return "classmethod" if "classmethod" in names else \
        "staticmethod" if "staticmethod" in names else "method"


def root(path: str) -> str:
    """The name a path starts from."""
    for i, ch in enumerate(path):
        if ch in ".[":
            return path[:i]
    return path


def targets(node) -> list:
    """The single targets of an assignment target (tuples unpacked)."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return [t for elt in node.elts for t in targets(elt)]
    return [node]


def functions(tree) -> dict[str, ast.AST]:
    """Functions and methods by qualified name (``Class.method``, ``f.inner``)."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = child
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)
    visit(tree, "")
    return out


def methods(tree) -> set[str]:
    """Qualified names (as `functions` gives them) of the functions defined
    directly in a class body."""
    out = set()

    def visit(node, prefix, in_class):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if in_class:
                    out.add(prefix + child.name)
                visit(child, prefix + child.name + ".", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".", True)
            else:
                visit(child, prefix, in_class)
    visit(tree, "", False)
    return out


# Receivers that are an instance or a class: an attribute called on them
# (self.m(), self.net.m(), cls.m(), super().m()) is a method, or an object
# held in an attribute (self.main = nn.Sequential(...)), never a module's
# function.
_OWN = {"self", "cls"}


def _on_instance(func: ast.Attribute) -> bool:
    node = func.value
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "super"
    return isinstance(node, ast.Name) and node.id in _OWN


def called_names(nodes, methods_apart: bool = False) -> set[str]:
    """Simple names of everything `nodes` call: f() gives f, a.b.m() gives
    m.  With `methods_apart`, an attribute called on an instance
    (`_on_instance`) gives ``.m``: it can reach only a method named m."""
    names = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                if isinstance(n.func, ast.Name):
                    names.add(n.func.id)
                elif isinstance(n.func, ast.Attribute):
                    own = methods_apart and _on_instance(n.func)
                    names.add(("." if own else "") + n.func.attr)
    return names


def call_graph(trees: dict[str, ast.AST]) -> tuple[dict[str, set[str]], set[str]]:
    """({``file:qualname``: what its body calls}, the keys that are
    methods) over `trees` ({file: module tree}).  What a function calls is
    given by simple names, f() and a.b.m() as f and m, except that an
    attribute called on self, cls or super() is ``.m``: a method.  A
    script's ``self.main(z)`` (an nn.Sequential held in an attribute) is
    then no call of its function ``main``."""
    calls, meths = {}, set()
    for rel, tree in trees.items():
        own = methods(tree)
        for qual, node in functions(tree).items():
            key = f"{rel}:{qual}"
            calls[key] = called_names(node.body, methods_apart=True)
            if qual in own:
                meths.add(key)
    return calls, meths


def reaches(called: set[str], key: str, meths: set[str]) -> bool:
    """Whether a function calling `called` (`call_graph`) may call the
    function `key`, a method when `meths` holds it."""
    simple = simple_name(key)
    return simple in called or (key in meths and "." + simple in called)


def callers_closure(changed: set[str], calls: dict[str, set[str]],
                    meths: set[str] = frozenset()) -> set[str]:
    """`changed` functions and every function that calls one of them,
    directly or not, as keys of `calls` (`call_graph`)."""
    affected = set(changed)
    grew = True
    while grew:
        grew = False
        for key, called in calls.items():
            if key not in affected and any(reaches(called, a, meths) for a in affected):
                affected.add(key)
                grew = True
    return affected


def simple_name(key: str) -> str:
    """The simple name of a `call_graph` key (``s.py:Net.forward`` gives
    forward)."""
    return key.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
