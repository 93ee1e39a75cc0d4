"""Probe detection for hands-free replay: what the user changed, and where.

The recorded and current scripts are flattened into statements (a compound
statement contributes its header, then its body one level deeper) and
matched in order.  An added statement is a *hindsight statement* when it is
log-like: an expression statement that assigns nothing and calls ``print``
or a ``print`` method (``accelerator.print``), ``flor.log``, ``logging.*`` or a logger, a TensorBoard ``SummaryWriter.add_*``,
``wandb.log`` or another ``*.log*`` function, or writes to a file or a
stream (``f.write``, ``writelines``, a csv writer's ``writerow(s)``), and
that calls no in-place tensor method (``mul_``), no method of training
state (``step``, ``zero_grad``, ``add_param_group`` ...) and nothing that
draws random numbers, advances an iterator or changes a container
(``torch.rand``, ``rs.randint``, ``next``, ``pop``: a plain run of the
edited script would train on other numbers or items).  Added imports are allowed too.
So are the lines probes are written with, when all of them are added and
change no training state (`_Shapes`, `_quiet`): a helper assignment to new
names that only added statements read (``gn = grad_norm(model)`` then
``print(gn)``), an accumulator of a number, an added ``if`` around
hindsight statements (``if step % 100 == 0: print(...)``), a ``for`` over a
container or the model's listings (never over a data loader), a new helper
function that only added statements call, and a new ``on_*`` method (a
callback's or a LightningModule's hook) that only logs and returns nothing.
Everything else (assignments to existing names, control flow around
existing code, changed arguments, deletions) is an *other change*: replay
warns, listing them, or refuses with --strict.

A block is stepped into when a change lies inside it, or when it calls
(directly or through other functions) a function of the script whose
definition changed, as the manual API decides (source.changed_functions);
every other block is skipped.
"""
from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

from .syntax import bodies, header, is_compound, own_nodes

__all__ = ["Probe", "detect", "is_log_like", "own_code"]

_LOGGER_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}
_WRITE_METHODS = {"write", "writelines", "writerow", "writerows"}
# Methods that change training state: a statement calling one is not log-like.
_STATE_METHODS = {"step", "zero_grad", "backward", "add_param_group", "load_state_dict",
                  "train", "eval", "apply", "register_buffer", "register_parameter",
                  "register_module", "add_module", "manual_seed", "seed", "set_rng_state",
                  "set_state", "setstate", "set_num_threads", "update"}


def state_changes(stmt) -> list[str]:
    """The calls in `stmt` that change state: in-place tensor methods
    (``mul_``, ``copy_``) and methods of training state (``step``,
    ``zero_grad``, ``add_param_group`` ...)."""
    out = []
    for n in ast.walk(stmt):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            name = n.func.attr
            if (name.endswith("_") and not name.startswith("_")) or name in _STATE_METHODS:
                out.append(f"{ast.unparse(n.func)}()")
    return out


@dataclass
class Probe:
    probed: set = field(default_factory=set)  # block keys to step into
    hindsight: list = field(default_factory=list)  # (line, source) in the current file
    other: list = field(default_factory=list)  # (line, description)


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    if isinstance(node, ast.Call):  # logging.getLogger(__name__).info(...)
        inner = _dotted(node.func)
        return f"{inner}()" + ("." + ".".join(reversed(parts)) if parts else "") \
            if inner else None
    return None


def own_code(tree) -> tuple[frozenset, frozenset]:
    """(the script's functions, its classes' methods), by name: a call of
    one runs the script's own code, whatever its name."""
    functions, methods = set(), set()
    in_class = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    methods.add(m.name)
                    in_class.add(id(m))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                id(node) not in in_class:
            functions.add(node.name)
    return frozenset(functions), frozenset(methods)


def is_log_like(stmt, own=(frozenset(), frozenset())) -> bool:
    """An expression statement that calls a logging function and assigns
    nothing.  `own` (own_code of the recorded script): a function or method
    of the script's own, named like a logging call (a meter's print() that
    resets it), is the script's code, not a logging call."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    if any(isinstance(n, ast.NamedExpr) for n in ast.walk(stmt)) or state_changes(stmt):
        return False
    if any(isinstance(n, ast.Call) and _called(n) in _CONSUMING for n in ast.walk(stmt)):
        return False  # print(rs.randint(100)), print(next(it)): a plain run draws them
    name = _dotted(stmt.value.func)
    if name is None:
        return False
    last = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 1)[0].lower() if "." in name else ""
    if last in (own[1] if owner else own[0]):
        return False
    if name in ("print", "pprint", "pprint.pprint"):
        return True
    if last == "print" and owner:  # accelerator.print, fabric.print, self.print, console.print
        return True
    if last.startswith("log") and owner:  # flor.log, wandb.log, mlflow.log_metric, run.log
        return True
    if last.startswith("add_") and owner:  # SummaryWriter.add_scalar, add_histogram, ...
        return True
    if last in _LOGGER_METHODS and ("log" in owner or owner.endswith("getlogger()")):
        return True  # logging.info, logger.info, log.warning
    if last in _WRITE_METHODS and owner:  # a file or a stream: f.write, csv_out.writerow
        return True
    return False


# Calls that a probe line's helper, guard or loop may not make: they
# advance an iterator, change a container or an object, draw random numbers
# (a plain run of the edited script would then train on other numbers), or
# hook into the model.
_CONSUMING = {"next", "setattr", "delattr", "exec", "eval", "globals", "locals", "vars",
              "pop", "popitem", "append", "extend", "insert", "remove", "clear", "setdefault",
              "send", "throw", "close", "rand", "randn", "randint", "randperm", "rand_like",
              "randn_like", "randint_like", "normal", "bernoulli", "multinomial", "poisson",
              "random", "choice", "choices", "shuffle", "sample", "uniform", "gauss",
              "integers", "permutation", "dropout"}
# What an added `for` may iterate: containers and the model's own listings,
# never an iterator or a data loader that the training consumes.
_LISTINGS = {"items", "keys", "values", "parameters", "named_parameters", "buffers",
             "named_buffers", "modules", "named_modules", "children", "named_children",
             "state_dict", "range"}
_WRAPPERS = {"enumerate", "zip", "sorted", "reversed", "list", "tuple"}


def _called(call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _quiet(node) -> bool:
    """Nothing in `node` (expressions) changes training state, binds a name,
    yields, or makes a call of _CONSUMING, a dunder or a register_* hook."""
    for n in ast.walk(node):
        if isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await, ast.Lambda)):
            return False
        if isinstance(n, ast.Call):
            name = _called(n)
            if name in _CONSUMING or name.startswith(("__", "register_")):
                return False
    return not state_changes(node)


def _listing(node) -> bool:
    """An iterable an added `for` may run over (_LISTINGS)."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return _quiet(node)
    if not isinstance(node, ast.Call) or not _quiet(node):
        return False
    name = _called(node)
    if name in _WRAPPERS:
        return bool(node.args) and all(_listing(a) for a in node.args)
    return name in _LISTINGS


def _names(target) -> list[str] | None:
    """The names a plain target binds (``a``, ``a, b``), else None."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        got = [_names(t) for t in target.elts]
        return None if None in got else [n for g in got for n in g]
    return None


def _bound(tree) -> set[str]:
    """Every name `tree` binds or reads, its functions', classes', arguments'
    and imports' names included."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            out.update(n.names)
    return out


class _Shapes:
    """Which added statements are the lines of a probe (the module's
    docstring): `accepted(node)` for an added statement of the current
    script.  A helper (an assignment, a for's target, a function) binds
    only names the recorded script never used, an accepted statement reads
    it, and no other code does; a statement that reads a name which an
    added, not accepted statement binds is not accepted.  That is a
    fixpoint: rejecting a statement can reject those that read its names."""

    def __init__(self, old_tree, new_tree, added):
        self.old = _bound(old_tree)
        self.own = own_code(old_tree)
        self.added = added  # ids of the added statements
        self.parent = {id(c): p for p in ast.walk(new_tree) for c in ast.iter_child_nodes(p)}
        self.statements = [n for n in ast.walk(new_tree) if isinstance(n, ast.stmt)]
        self.rejected: set[str] = set()  # names no helper may bind
        self.tainted: set[str] = set()  # names bound by added statements not accepted
        while True:
            self.memo = {}
            rejected, tainted = self._settle()
            if rejected <= self.rejected and tainted <= self.tainted:
                break
            self.rejected |= rejected
            self.tainted |= tainted

    def accepted(self, node) -> bool:
        """`node` and every added statement around it are probe lines."""
        p = node
        while p is not None and id(p) in self.added:
            if not self._local(p):
                return False
            p = self.parent.get(id(p))
        return id(node) in self.added

    def _local(self, node) -> bool:
        if id(node) not in self.memo:
            self.memo[id(node)] = self._shape(node) and not self._reads(node) & self.tainted
        return self.memo[id(node)]

    def _function(self, node):
        """The function `node` is in, if any."""
        p = self.parent.get(id(node))
        while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
            p = self.parent.get(id(p))
        return p

    def _own(self, node) -> bool:
        """`node` is in an added function: the names it binds are that function's."""
        fn = self._function(node)
        return fn is not None and id(fn) in self.added

    def _fresh(self, names, node) -> bool:
        """Names a helper may bind: its function's own, or new to the script
        and not rejected."""
        return bool(names) and (self._own(node) or not (set(names) & (self.old | self.rejected)))

    def _made_here(self, name, node, kinds) -> bool:
        """`name` is bound, in `node`'s function (or module), by an added
        assignment of a value of `kinds` (a new container, a number)."""
        fn = self._function(node)
        return any(isinstance(n, ast.Assign) and id(n) in self.added and
                   isinstance(n.value, kinds) and self._function(n) is fn and
                   any(name in (_names(t) or []) for t in n.targets)
                   for n in self.statements)

    def _target(self, target, node) -> bool:
        """A target a helper may assign: fresh names, or an item of a
        container its added function made (``out = {}``, ``out[name] = ...``)."""
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            return self._own(node) and _quiet(target.slice) and self._made_here(
                target.value.id, node, (ast.Dict, ast.List, ast.DictComp, ast.ListComp))
        return self._fresh(_names(target), node)

    def _body(self, node) -> bool:
        subs = [x for _, sub in bodies(node) for x in sub]
        return all(isinstance(x, ast.stmt) and id(x) in self.added and self._local(x)
                   for x in subs)

    def _shape(self, node) -> bool:
        if is_log_like(node, self.own) or isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
            return True
        if isinstance(self.parent.get(id(node)), ast.ClassDef) and \
                not isinstance(node, ast.FunctionDef):
            return False  # a class attribute, which may override a base class's
        if isinstance(node, ast.Assign):
            return _quiet(node.value) and all(self._target(t, node) for t in node.targets)
        if isinstance(node, ast.AugAssign):  # an accumulator: a number added to
            return _quiet(node.value) and isinstance(node.target, ast.Name) and \
                self._fresh([node.target.id], node) and \
                self._made_here(node.target.id, node, (ast.Constant, ast.UnaryOp))
        if isinstance(node, ast.Return):  # of an added helper function, not of a method
            fn = self._function(node)
            return fn is not None and id(fn) in self.added and not self._method(fn) and \
                (node.value is None or _quiet(node.value))
        if isinstance(node, ast.If):
            return _quiet(node.test) and self._body(node)
        if isinstance(node, ast.For):
            return _listing(node.iter) and self._fresh(_names(node.target), node) and \
                self._body(node)
        if isinstance(node, ast.FunctionDef):
            heads = [*node.decorator_list, *node.args.defaults,
                     *[d for d in node.args.kw_defaults if d is not None]]
            return all(_quiet(h) for h in heads) and node.name not in self.old and \
                (self._hook(node) if self._method(node) else node.name not in self.rejected) \
                and self._body(node)
        return False

    def _method(self, fn) -> bool:
        return isinstance(self.parent.get(id(fn)), ast.ClassDef)

    @staticmethod
    def _hook(fn) -> bool:
        """A new method may be a callback's hook (``on_step_end``,
        ``on_train_batch_end``): any other name may override what a base
        class does (``train``, ``zero_grad``, ``backward``, ``__setattr__``)."""
        return fn.name.startswith("on_") and not fn.decorator_list

    @staticmethod
    def _reads(node) -> set[str]:
        """The names a statement's own expressions read (a compound
        statement's header, not its body)."""
        return {x.id for part in (own_nodes(node) if is_compound(node) else [node])
                for x in ast.walk(part) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}

    @staticmethod
    def _binds(node) -> set[str]:
        if isinstance(node, ast.Assign):
            return {x for t in node.targets for x in (_names(t) or [])}
        if isinstance(node, (ast.AugAssign, ast.For)):
            return set(_names(node.target) or [])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        return set()

    def _settle(self):
        """(names helpers may not bind, names whose readers are rejected)
        given the statements accepted now."""
        helpers, values, tainted, by_accepted, by_others = set(), set(), set(), set(), set()
        for n in self.statements:
            ok = self.accepted(n)
            if id(n) in self.added and not self._own(n) and not \
                    (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and self._method(n)):
                (helpers if ok else tainted).update(self._binds(n) - self.old)
                if ok and not isinstance(n, ast.For):  # a loop's names need no reader
                    values.update(self._binds(n) - self.old)
            (by_accepted if ok else by_others).update(self._reads(n))
        return (helpers & by_others) | (values - by_accepted), tainted


def _flatten(stmts, depth, out):
    for s in stmts:
        if not is_compound(s):
            out.append((f"{depth}|{ast.dump(s)}", s, depth))
            continue
        out.append((f"{depth}|{ast.dump(header(s))}", s, depth))
        for f, sub in bodies(s):
            if f in ("orelse", "finalbody"):
                out.append((f"{depth + 1}|<{f}>", s, depth + 1))
            for x in sub:
                if isinstance(x, (ast.ExceptHandler, ast.match_case)):
                    out.append((f"{depth + 1}|{ast.dump(header(x))}", x, depth + 1))
                    _flatten(x.body, depth + 2, out)
                else:
                    _flatten([x], depth + 1, out)
    return out


def _describe(node, lines) -> str:
    line = getattr(node, "lineno", None)
    text = lines[line - 1].strip() if line and line <= len(lines) else type(node).__name__
    return text


def detect(old_source: str, new_source: str, inst, changed: set[str]) -> Probe:
    """Compare the recorded and current scripts.  `inst` is the instrumented
    current script (its blocks, in current line numbers); `changed` names the
    functions whose definition changed and their callers
    (source.changed_functions)."""
    old_tree, new_tree = ast.parse(old_source), ast.parse(new_source)
    old = _flatten(old_tree.body, 0, [])
    new = _flatten(new_tree.body, 0, [])
    old_lines, new_lines = old_source.splitlines(), new_source.splitlines()
    probe = Probe()
    changed_lines = []
    sm = difflib.SequenceMatcher(None, [t for t, _, _ in old], [t for t, _, _ in new],
                                 autojunk=False)
    opcodes = sm.get_opcodes()
    shapes = _Shapes(old_tree, new_tree, {id(node) for tag, _, _, j1, j2 in opcodes
                                          if tag == "insert" for _, node, _ in new[j1:j2]})
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            continue
        for _, node, _ in new[j1:j2]:
            line = getattr(node, "lineno", None)
            if tag == "insert" and isinstance(node, (ast.Import, ast.ImportFrom)):
                pass  # an import for a hindsight statement
            elif tag == "insert" and shapes.accepted(node):
                probe.hindsight.append((line, _describe(node, new_lines)))
            elif tag == "insert" and state_changes(node):
                probe.other.append((line, f"changes state (calls {', '.join(state_changes(node))}"
                                          f"): {_describe(node, new_lines)}"))
            else:
                probe.other.append((line, ("changed: " if tag == "replace" else "added: ")
                                    + _describe(node, new_lines)))
            if line is not None:
                changed_lines.append(line)
        if tag in ("delete", "replace") and i2 > i1:
            at = new[j1][1] if j1 < len(new) else (new[-1][1] if new else None)
            line = getattr(at, "lineno", None)
            for _, node, _ in old[i1:i2]:
                if tag == "delete":
                    probe.other.append((line, "removed: " + _describe(node, old_lines)))
            if line is not None:
                changed_lines.append(line)
    for b in inst.blocks:
        if any(b.line <= ln <= b.end_line for ln in changed_lines) or set(b.calls) & changed:
            probe.probed.add(b.key)
    return probe
