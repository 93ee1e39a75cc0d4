"""Queries over runs: which runs to keep, and in what order, by their
parameters and by what they logged (``flor runs --where/--sort``,
``flor.dataframe(where=, sort=)``).

An expression is a small piece of Python syntax, parsed and checked here,
never evaluated by Python:

    lr <= 0.01 and max(val_acc) > 0.9
    not (optimizer == "sgd" or epochs < 5)

- A name (dotted for a config object's keys: ``model.depth``) is the
  run's parameter of that name (its script's parsed arguments and config
  objects: the columns ``flor.dataframe`` gives them),
  or, where the run has no such parameter, the last value the run logged
  under that name (``flor.log``), or else the last number of that name in
  its printed lines (``train_loss`` in ``epoch 3 train loss 0.23``; the
  first printed statement that has it).
- ``last(NAME)``, ``first(NAME)``, ``min(NAME)``, ``max(NAME)`` and
  ``mean(NAME)`` are taken over every number the run logged (or printed)
  under NAME, in the order logged (a bool counts as 0 or 1); ``count(NAME)``
  is how many values it logged under NAME (0 where none).
- Comparisons (``<``, ``<=``, ``>``, ``>=``, ``==``, ``!=``, chained as in
  Python), ``and``, ``or``, ``not``, parentheses, numbers, quoted strings,
  ``True``, ``False`` and ``None``; ``-`` before a number or a name.
- A run that lacks a name (no such parameter or value) makes a
  comparison with it unknown, as SQL's NULL does: ``not`` of it is unknown
  too, ``and``/``or`` decide where another operand does, and a run
  matches only an expression that is true.  It sorts after the runs that
  have a value.

A sort key is an expression of one value (a name or an aggregate), with a
leading ``-`` for descending order: ``-max(val_acc)``.
"""
from __future__ import annotations

import ast
import math
import operator

from .frames import Values, script_args, select_runs
from .printed import split as split_printed

__all__ = ["Query", "QueryError", "SortKey", "RunValues", "select"]

_AGGREGATES = {  # over a name's numbers; count(NAME) counts every value
    "last": lambda xs: xs[-1],
    "first": lambda xs: xs[0],
    "min": min,
    "max": max,
    "mean": lambda xs: sum(xs) / len(xs),
}
_CALLS = (*_AGGREGATES, "count")
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
            ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}
_MISSING = object()


class QueryError(ValueError):
    """An expression this module does not take, and why."""


MAX_DEPTH = 100  # of an expression's nesting: deeper is refused, not a RecursionError


def _parse(text, what: str) -> ast.expr:
    if not isinstance(text, str):
        raise QueryError(f"{what} must be a string, not {type(text).__name__} ({text!r})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise QueryError(f"{what} {text!r} does not parse: {e.msg} (docs/results.md, "
                         "Queries)") from None
    except (RecursionError, MemoryError):
        tree = None
    if tree is None or _depth(tree.body) > MAX_DEPTH:
        raise QueryError(f"{what} {text!r} nests deeper than {MAX_DEPTH} levels")
    _check(tree.body, text, what)
    return tree.body


def _depth(node) -> int:
    """How deep the tree under `node` nests (walked without recursion)."""
    deepest, todo = 0, [(node, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def dotted(node) -> str | None:
    """The name a Name or a chain of attributes over one spells
    (``model.depth``: a config object's key), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _check(node, text, what):
    """Refuse anything but the syntax the module documents."""
    if isinstance(node, ast.BoolOp) or (isinstance(node, ast.UnaryOp) and
                                        isinstance(node.op, (ast.Not, ast.USub))):
        for child in (node.values if isinstance(node, ast.BoolOp) else [node.operand]):
            _check(child, text, what)
    elif isinstance(node, ast.Compare):
        if not all(type(op) in _COMPARE for op in node.ops):
            raise QueryError(f"{what} {text!r}: only <, <=, >, >=, == and != compare")
        for child in (node.left, *node.comparators):
            _check(child, text, what)
    elif isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in _CALLS or node.keywords or len(node.args) != 1 \
                or dotted(node.args[0]) is None:
            raise QueryError(f"{what} {text!r}: a call is one of "
                             f"{', '.join(f'{a}(NAME)' for a in _CALLS)}")
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, bool, type(None))):
            raise QueryError(f"{what} {text!r}: {node.value!r} is not a number or a string")
    elif dotted(node) is None:
        raise QueryError(f"{what} {text!r}: {ast.unparse(node)!r} is not a name, a value, "
                         "an aggregate, a comparison, and, or or not")


class RunValues:
    """What an expression reads of one run: its parameters, and its values
    by name, read once when first asked for."""

    def __init__(self, store, run):
        self.store, self.run = store, run
        self._params = None
        self._values = None

    def params(self) -> dict:
        if self._params is None:
            self._params = script_args(self.run, self.store)
        return self._params

    def values(self, name) -> list:
        """Every value the run logged under `name`, or printed as a number of
        that name, in the order logged ([] where it has none)."""
        if self._values is None:
            self._values = Values(self.store, [self.run], None, printed=True, fields=True).rows
        rows = self._values.get(name)
        if rows is None:
            rows = next((got for full, got in self._values.items()
                         if split_printed(full)[1] == name), [])
        return [row[3] for row in rows]

    def name(self, name):
        """A name: the parameter, else the last value logged or printed."""
        params = self.params()
        if name in params:
            return params[name]
        got = self.values(name)
        return got[-1] if got else _MISSING


def _eval(node, rv: RunValues):
    """The node's value for the run; a condition is True, False or _MISSING
    (unknown: a name the run lacks), as in SQL."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Call):
        values = rv.values(dotted(node.args[0]))
        if node.func.id == "count":
            return len(values)
        xs = [x for x in values if _number(x)]
        return _AGGREGATES[node.func.id](xs) if xs else _MISSING
    if isinstance(node, ast.UnaryOp):
        got = _eval(node.operand, rv)
        if isinstance(node.op, ast.Not):
            return _MISSING if got is _MISSING else not got
        return -got if _number(got) else _MISSING
    if isinstance(node, ast.BoolOp):
        got = [_eval(v, rv) for v in node.values]
        decisive = isinstance(node.op, ast.Or)  # or: any True; and: any False
        if any(g is not _MISSING and bool(g) is decisive for g in got):
            return decisive
        return _MISSING if any(g is _MISSING for g in got) else not decisive
    if isinstance(node, ast.Compare):  # chained: each link, as `and` of them
        links, left = [], _eval(node.left, rv)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, rv)
            links.append(_MISSING if left is _MISSING or right is _MISSING
                         or not _comparable(left, right, op)
                         else _COMPARE[type(op)](left, right))
            left = right
        if any(link is False for link in links):
            return False
        return _MISSING if any(link is _MISSING for link in links) else True
    return rv.name(dotted(node))


def _number(x) -> bool:
    """A number to order and aggregate (a bool counts as 0 or 1, as in
    Python); NaN is none."""
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def _comparable(a, b, op) -> bool:
    if isinstance(op, (ast.Eq, ast.NotEq)):
        return True
    return (_number(a) and _number(b)) or (isinstance(a, str) and isinstance(b, str))


class Query:
    """A filter over runs: `matches(RunValues(store, run))`."""

    def __init__(self, text: str):
        self.text = text
        self.tree = _parse(text, "the query")

    def truth(self, values: RunValues):
        """True, False, or None where it is unknown (a name the run lacks)."""
        got = _eval(self.tree, values)
        return None if got is _MISSING else bool(got)

    def matches(self, values: RunValues) -> bool:
        return self.truth(values) is True


class SortKey:
    """An order of runs: ``[-]EXPR`` with EXPR a name or an aggregate."""

    def __init__(self, text: str):
        self.text = text
        if not isinstance(text, str):
            raise QueryError(f"the sort key must be a string, not {type(text).__name__} "
                             f"({text!r})")
        body = text.strip()
        self.descending = body.startswith("-")
        self.tree = _parse(body[1:] if self.descending else body, "the sort key")
        if not isinstance(self.tree, ast.Call) and dotted(self.tree) is None:
            raise QueryError(f"the sort key {text!r} is not a name or an aggregate "
                             "(with a leading - for descending order)")

    def sort(self, runs: list[RunValues]) -> list[RunValues]:
        """`runs` in this order; those without a value after the others, in
        the order given; numbers before strings where both occur."""
        keyed, missing = [], []
        for i, rv in enumerate(runs):
            got = _eval(self.tree, rv)
            if got is _MISSING or not (_number(got) or isinstance(got, str)):
                missing.append(rv)
            else:
                keyed.append((isinstance(got, str), got, i, rv))
        sign = -1 if self.descending else 1  # (ties keep the order given)
        nums = sorted((k for k in keyed if not k[0]), key=lambda k: (k[1], sign * k[2]),
                      reverse=self.descending)
        strs = sorted((k for k in keyed if k[0]), key=lambda k: (k[1], sign * k[2]),
                      reverse=self.descending)
        return [k[3] for k in nums + strs] + missing


def select(store, script=None, run=None, runs=None, where=None, sort=None) -> list[str]:
    """The ids of the runs flor.dataframe reads (frames.select_runs) for
    which `where` holds, in the order of `sort` (expressions, or None)."""
    query = None if where is None else Query(where)
    key = None if sort is None else SortKey(sort)
    chosen = [rv for rv in (RunValues(store, r) for r in select_runs(store, script, run, runs))
              if query is None or query.matches(rv)]
    if not chosen:
        raise LookupError(f"no finished run of the script matches {where!r} in {store.root}")
    return [rv.run["run_id"] for rv in (chosen if key is None else key.sort(chosen))]
