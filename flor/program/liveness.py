"""Which names a loop body reads before it assigns them: what one iteration
hands to the next.

    exposed(body, bound) -> the names read, on some path from the top of
        `body`, before an assignment of them on that path; `bound` are
        assigned first (a for loop's targets: the header binds them
        before every iteration)
    definite(body, bound) -> the names it assigns on every path

program/instrument.py carries into the next iteration what the body reads
before it assigns it, what it assigns on some paths only (last iteration's
value may live on, after the loop too), and what a function or lambda reads
(it may run anywhere); never a name the loop header binds: putting back last
iteration's value would replace the one the header has just bound.  The
analysis errs towards exposure: a branch that leaves early (break,
continue, return, raise) is taken to fall through, and an assignment inside
a loop, a try, a with or one branch of an if, or by :=, is not counted as
made.  Comprehensions and lambdas read the names of their own scope apart.
"""
from __future__ import annotations

import ast

__all__ = ["exposed", "definite", "function_reads", "reads", "target_names"]


def target_names(target) -> set[str]:
    """The names an assignment target binds (not those it reads: a[i])."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(target_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return target_names(target.value)
    return set()


def reads(node) -> set[str]:
    """Names an expression (or a target's subscripts and attributes) reads."""
    if node is None:
        return set()
    if isinstance(node, ast.Name):
        return {node.id} if isinstance(node.ctx, ast.Load) else set()
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        out, local = set(), set()
        for i, gen in enumerate(node.generators):
            iter_reads = reads(gen.iter)
            out |= iter_reads if i == 0 else iter_reads - local
            local |= target_names(gen.target)
            out |= set().union(*(reads(c) for c in gen.ifs)) - local if gen.ifs else set()
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        return out | (set().union(*(reads(p) for p in parts)) - local)
    if isinstance(node, ast.Lambda):
        a = node.args
        params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        params |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
        defaults = set().union(*(reads(d) for d in a.defaults + a.kw_defaults if d is not None)) \
            if (a.defaults or a.kw_defaults) else set()
        return defaults | (reads(node.body) - params)
    out = set()
    for child in ast.iter_child_nodes(node):
        out |= reads(child)
    return out


def _walrus(node) -> set[str]:
    """Names := binds inside an expression: none counts as made, since the
    expression may not evaluate it (a short-circuit `and`)."""
    return set()


def exposed(stmts, bound=frozenset()) -> set[str]:
    """Names read in `stmts` before they are assigned (see the module)."""
    out, _ = _block(stmts, frozenset(bound))
    return out


def definite(stmts, bound=frozenset()) -> set[str]:
    """Names `stmts` assign on every path (`bound` included)."""
    _, made = _block(stmts, frozenset(bound))
    return set(made)


def function_reads(tree, scope=None) -> set[str]:
    """Names read inside any function, lambda or class of `tree` but the
    function `scope` itself (its nested ones count): such a reader may run
    at any point of a loop body (a callback, a scheduler's lambda), so its
    names count as read there."""
    out = set()
    for n in ast.walk(tree):
        if n is not scope and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                             ast.ClassDef)):
            out |= {x.id for x in ast.walk(n) if isinstance(x, ast.Name)
                    and isinstance(x.ctx, ast.Load)}
    return out


def _block(stmts, defined):
    out = set()
    for s in stmts:
        got, defined = _stmt(s, defined)
        out |= got
    return out, defined


def _stmt(s, defined):
    """(names read before assigned, names assigned after) for a statement."""
    if isinstance(s, (ast.Assign, ast.AnnAssign)):
        targets = s.targets if isinstance(s, ast.Assign) else [s.target]
        value = s.value
        got = reads(value) | set().union(*(reads(t) for t in targets))
        made = set().union(*(target_names(t) for t in targets)) if value is not None else set()
        return got - defined, defined | made | _walrus(value or ast.Pass())
    if isinstance(s, ast.AugAssign):  # x += 1 reads x
        got = reads(s.value) | reads(s.target) | target_names(s.target)
        return got - defined, defined | target_names(s.target)
    if isinstance(s, ast.If):
        out = reads(s.test) - defined
        defined = defined | _walrus(s.test)
        a, da = _block(s.body, defined)
        b, db = _block(s.orelse, defined)
        return out | a | b, da & db
    if isinstance(s, (ast.For, ast.AsyncFor)):
        out = reads(s.iter) - defined
        a, _ = _block(s.body, defined | target_names(s.target))
        b, _ = _block(s.orelse, defined)
        return out | a | b, defined  # the body may not run
    if isinstance(s, ast.While):
        out = reads(s.test) - defined
        a, _ = _block(s.body, defined | _walrus(s.test))
        b, _ = _block(s.orelse, defined)
        return out | a | b, defined
    if isinstance(s, (ast.With, ast.AsyncWith)):
        out = set()
        for item in s.items:
            out |= reads(item.context_expr) - defined
            defined = defined | target_names(item.optional_vars)
        a, _ = _block(s.body, defined)  # a context manager may suppress what raised
        return out | a, defined
    if isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
        out, _ = _block(s.body, defined)  # any of it may not have run
        for h in s.handlers:
            got, _ = _block(h.body, defined | ({h.name} if h.name else set()))
            out |= (reads(h.type) - defined) | got
        got, _ = _block(s.orelse, defined)
        fin, defined = _block(s.finalbody, defined)
        return out | got | fin, defined
    if isinstance(s, ast.Match):
        out = reads(s.subject) - defined
        for case in s.cases:
            got, _ = _block(case.body, defined | _pattern_names(case.pattern))
            out |= got | (reads(case.guard) - defined)
        return out, defined
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        # What a nested function or class reads, it reads when called: taken
        # as read here.
        inner = {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        return inner - defined, defined | {s.name}
    if isinstance(s, (ast.Import, ast.ImportFrom)):
        return set(), defined | {(a.asname or a.name).split(".")[0] for a in s.names}
    if isinstance(s, ast.Delete):
        return set().union(*(reads(t) for t in s.targets)) - defined, defined
    return reads(s) - defined, defined | _walrus(s)


def _pattern_names(pattern) -> set[str]:
    return {n.name for n in ast.walk(pattern)
            if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name} | \
        {n.rest for n in ast.walk(pattern) if isinstance(n, ast.MatchMapping) and n.rest}
