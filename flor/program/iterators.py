"""What a block does to an iterator it reads: it advances it.

An iterator's position decides what the code after the block draws, so an
iterator the block advances is part of what the block changes:

- ``next(it)`` advances ``it`` (a change in place, rule 1 of analysis.py);
- ``for x in it:`` and a comprehension over ``it`` advance ``it`` when its
  value is an iterator, and so do ``enumerate(it)``, ``zip(it, ...)``,
  ``itertools.islice(it, n)`` and the like over it, and ``list(it)``,
  ``sorted(it)``, ``sum(it)``...: ``it`` is *iterated*.  So is a list or a
  dict of iterators indexed by a variable (``streams[k]``: the path stops
  at ``streams``).
  Whether it is an iterator is known only at run time: a list, a tensor, a
  ``DataLoader`` is iterated afresh by each loop, and is no state of the
  block's.

A block that advances an iterator no checkpoint holds (a generator, a
``DataLoader``'s iterator) is never checkpointed: replay runs it again.
A block that iterates one is never checkpointed either, where code after
it reads it and it is an iterator at run time (flor/runtime/handsfree.py):
its checkpoint does not hold it.
"""
from __future__ import annotations

import ast

from .syntax import path_of, root

__all__ = ["advanced", "iterated"]

# Calls that iterate over (some of) their arguments: lazily, as the loop over
# them goes, or at once (list(it), sorted(it), sum(it)); either way they
# advance each argument that is an iterator.
WRAPPERS = {"enumerate", "zip", "map", "filter", "iter", "islice", "chain", "cycle",
            "takewhile", "dropwhile", "compress", "starmap", "zip_longest", "pairwise",
            "accumulate", "batched", "groupby", "tqdm", "trange"}
EAGER = {"list", "tuple", "sorted", "set", "frozenset", "dict", "sum", "min", "max", "any",
         "all", "stack", "cat"}


def _nodes(expr):
    return [] if expr is None else [x for e in (expr if isinstance(expr, list) else [expr])
                                    for x in ast.walk(e)]


def advanced(script, expr, eff):
    """next(it) in `expr` advances the iterator `it`: a change in place (rule 1)."""
    for n in _nodes(expr):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "next" \
                and "next" not in script.functions and n.args:
            obj = path_of(n.args[0])
            if obj is not None and root(obj) not in script.not_state:
                eff.add(obj, 1)


def _sources(script, expr) -> list[str]:
    """The paths a loop over `expr` iterates: `expr` itself, or the
    arguments of a lazy wrapper around them."""
    p = path_of(expr) if isinstance(expr, (ast.Name, ast.Attribute, ast.Subscript)) else None
    if p is not None:
        return [p] if root(p) not in script.not_state else []
    if isinstance(expr, ast.Call):
        f = expr.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
            else None
        if (name in WRAPPERS or name in EAGER) and name not in script.functions:
            return [q for a in expr.args for q in _sources(script, a)]
    return []


def iterated(script, s, eff):
    """Add to ``eff.iterated`` the paths statement `s` loops over (in its
    own header, and in the comprehensions of its own expressions): it
    advances them if they are iterators."""
    heads = [s.iter] if isinstance(s, (ast.For, ast.AsyncFor)) else []
    for attr in ("value", "iter", "test", "items"):
        for n in _nodes(getattr(s, attr, None)):
            if isinstance(n, ast.comprehension):
                heads.append(n.iter)
            elif isinstance(n, ast.Call):  # list(islice(it, 3)), a wrapper anywhere
                heads.append(n)
    for head in heads:
        eff.iterated.update(_sources(script, head))
