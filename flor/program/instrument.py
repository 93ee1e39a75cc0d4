"""Hands-free mode: instrument an unmodified training script in memory.

Every loop that is not nested in another loop of its function (or of the
module) is a *candidate main loop*: its iterator is wrapped so that flor
times it and, when it runs at the top level of the program, tracks its
iterations as ``flor.generator`` does.  The longest-running one is the main
loop, which replay splits among workers.  A ``while`` loop becomes

    for __flor_i in __flor__.loop(__flor__.count(), KEY, CARRIED...):
        if not (CONDITION):
            ELSE-CLAUSE
            break
        BODY

CARRIED is what the body carries into the next iteration (its side-effect
set, as for a block below), which iteration checkpoints hold; the body
starts with ``__flor_r = __flor__.resume(KEY)`` and, if that is not None,
rebinds the carried names from it (after a restore of an iteration
checkpoint).

Inside a candidate's body, each nested loop, and each call of a function of
the script that runs a loop (``train(model, loader, opt)``,
``acc = evaluate(model, loader)``), becomes a SkipBlock whose side effects are
estimated by analysis.py:

    if __flor__.step_into(KEY, OWNER, NAMES, PATHS, GLOBALS, REBOUND):
        try:
            STATEMENT
        except BaseException:
            __flor__.abandon()
            raise
    a, b = __flor__.end(KEY, ("a", "b"), PATHS, GLOBALS, REBOUND)

(in replay, step_into compares what end() would capture with what the
checkpoint holds, and re-executes the block when they differ)

Generated nodes carry the line of the statement they wrap, so tracebacks,
``flor.log`` locations and checks use the user's own line numbers.  A loop
whose line (or the line above it) has the comment ``# flor: skip`` is left
alone, and so is one whose analysis gives up: it then runs on replay too.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from .analysis import GiveUp, Modules, Script, block_effects
from .gradients import gradients_live, loop_gradients_live, scheduler_names
from .liveness import definite, exposed, function_reads, reads, target_names
from .syntax import assigned_names, bodies, called_names, functions, root, walk_scope

__all__ = ["instrument", "Instrumented", "uses_flor", "RUNTIME"]

RUNTIME = "__flor__"
SKIP_COMMENT = re.compile(r"#\s*flor:\s*skip\b")
LOOPS = (ast.For, ast.While)


@dataclass
class Block:
    key: str
    line: int
    end_line: int
    owner: str  # the candidate loop it belongs to
    kind: str  # "loop" or "call"
    names: list  # rebound in the block's scope by the end() statement
    paths: list  # attributes and items, set in place or by the runtime
    globals: list  # module globals a called function sets
    rebound: list  # paths the block assigns (restored by rebinding)
    dropped: list  # loop-scoped, removed
    unknown: list  # lines of calls with no estimate
    calls: list  # simple names the block calls
    reads: list  # names the block references
    grads: bool  # its parameters' gradients are read after it (program/gradients.py)


@dataclass
class Loop:
    key: str
    line: int
    end_line: int
    function: str  # "<module>" or the qualified name
    carried: list | None = None  # [names, paths, globals, rebound] into the next iteration
    grads: bool = False  # an iteration's gradients are read by the next one (accumulation)


@dataclass
class Instrumented:
    code: object
    text: str  # the instrumented source (ast.unparse), saved with the run
    loops: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    left_alone: list = field(default_factory=list)  # (line, reason)
    functions: dict = field(default_factory=dict)  # qualname -> (first, last, calls)

    def summary(self) -> dict:
        return {"loops": [vars(x) for x in self.loops],
                "blocks": [vars(b) for b in self.blocks],
                "left_alone": [list(x) for x in self.left_alone],
                "functions": {k: list(v[:2]) + [sorted(v[2])]
                              for k, v in self.functions.items()}}


def uses_flor(source: str) -> bool:
    """Whether the script imports flor (then it uses the manual API)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "flor" for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "flor" \
                and n.level == 0:
            return True
    return False


def _rewrite_bodies(stmt, rewrite):
    """Replace each statement list of a compound statement (if, with, try,
    match: bodies, else, finally, handlers, cases) by rewrite(list)."""
    for name, sub in bodies(stmt):
        if name in ("handlers", "cases"):
            for part in sub:
                part.body = rewrite(part.body)
        else:
            setattr(stmt, name, rewrite(sub))


def _rt(attr):
    return ast.Attribute(value=ast.Name(id=RUNTIME, ctx=ast.Load()), attr=attr, ctx=ast.Load())


def _call(attr, *args):
    return ast.Call(func=_rt(attr), args=list(args), keywords=[])


def _strs(items):
    return ast.Tuple(elts=[ast.Constant(value=x) for x in items], ctx=ast.Load())


def _at(node, line):
    """Give `node` and everything under it that lacks one the location `line`."""
    for n in ast.walk(node):
        if "lineno" in n._attributes and getattr(n, "lineno", None) is None:
            n.lineno, n.end_lineno, n.col_offset, n.end_col_offset = line, line, 0, 0
    return node


def _break_or_continue_outside_loops(stmts) -> bool:
    stack = list(stmts)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.Break, ast.Continue)):
            return True
        if isinstance(n, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef,
                          ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(n))
    return False


class _Instrumenter:
    def __init__(self, source, filename, key_of, modules=None, imported=False):
        self.imported = imported  # a module the script imports: not its import-time loops
        self.tree = ast.parse(source, filename)
        self.lines = source.splitlines()
        self.key_of = key_of
        self.script = Script(self.tree, filename, modules)
        self.schedulers = scheduler_names(self.tree)
        self.loop_body = None  # the body of the candidate loop being instrumented
        self.out = None

    def opted_out(self, node) -> bool:
        for ln in (node.lineno, node.lineno - 1):
            if 1 <= ln <= len(self.lines) and SKIP_COMMENT.search(self.lines[ln - 1]):
                return True
        return False

    def run(self, filename) -> Instrumented:
        self.out = Instrumented(code=None, text="")
        self.out.functions = {q: (f.lineno, f.end_lineno, called_names(f.body))
                              for q, f in functions(self.tree).items()}
        self.tree.body = self._scope(self.tree.body, self.tree, "<module>")
        ast.fix_missing_locations(self.tree)
        self.out.code = compile(self.tree, filename, "exec", dont_inherit=True)
        self.out.text = ast.unparse(self.tree)
        return self.out

    # -- scopes and candidate main loops ------------------------------------

    def _scope(self, stmts, scope, qualname):
        """Instrument the statements of a scope (module or function body)."""
        out = []
        for s in stmts:
            if isinstance(s, ast.FunctionDef):
                # (a model's forward: its loops are no training loop, and a
                # compiled forward must not call flor)
                if s.name != "forward" and not any(isinstance(n, (ast.Yield, ast.YieldFrom))
                                                   for n in walk_scope(s.body)):
                    s.body = self._scope(s.body, s, _q(qualname, s.name))
                out.append(s)
            elif isinstance(s, ast.ClassDef):
                for i, m in enumerate(s.body):
                    if isinstance(m, ast.FunctionDef):
                        s.body[i:i + 1] = self._scope([m], scope, _q(qualname, s.name))
                out.append(s)
            elif isinstance(s, LOOPS) and not (self.imported and scope is self.tree):
                out.extend(self._candidate(s, scope, qualname))
            else:
                _rewrite_bodies(s, lambda b: self._scope(b, scope, qualname))
                out.append(s)
        return out

    def _candidate(self, loop, scope, qualname):
        if self.opted_out(loop):
            self.out.left_alone.append((loop.lineno, "# flor: skip"))
            return [loop]
        if isinstance(loop, ast.While) and loop.orelse and \
                _break_or_continue_outside_loops(loop.orelse):
            self.out.left_alone.append((loop.lineno, "its else clause breaks or continues"))
            return [loop]
        key = self.key_of(loop.lineno)
        carried = self._carried(loop, scope)
        grads = bool(carried) and loop_gradients_live(
            loop.body, lambda call: self.script.resolve(call, scope), self.schedulers)
        self.out.loops.append(Loop(key, loop.lineno, loop.end_lineno, qualname,
                                   carried=list(map(list, carried)) if carried else None,
                                   grads=grads))
        self.loop_body = loop.body
        header = target_names(loop.target) if isinstance(loop, ast.For) else set()
        # What a block changes matters after it if the loop carries it, code
        # after the loop or another statement of the body reads it.
        self.after_block = (self._live(loop, header, scope) - header) | _loads_outside(scope, loop)
        loop.body = self._main_body(loop.body, key, scope)
        line = loop.lineno
        extra = [_strs(x) for x in carried] + [ast.Constant(value=grads)] if carried else []
        resume = []
        if carried and carried[0]:  # names to rebind after a restore
            resume = [ast.Assign(targets=[ast.Name(id="__flor_r", ctx=ast.Store())],
                                 value=_call("resume", ast.Constant(value=key)),
                                 type_comment=None),
                      ast.If(test=ast.Compare(left=ast.Name(id="__flor_r", ctx=ast.Load()),
                                              ops=[ast.IsNot()],
                                              comparators=[ast.Constant(value=None)]),
                             body=[ast.Assign(targets=[ast.Tuple(
                                 elts=[ast.Name(id=n, ctx=ast.Store()) for n in carried[0]],
                                 ctx=ast.Store())], value=ast.Name(id="__flor_r", ctx=ast.Load()),
                                 type_comment=None)], orelse=[])]
            resume = [_at(r, line) for r in resume]
        if isinstance(loop, ast.For):
            loop.iter = _at(_call("loop", loop.iter, ast.Constant(value=key), *extra), line)
            loop.body = resume + loop.body
            return [loop]
        test = ast.If(test=ast.UnaryOp(op=ast.Not(), operand=loop.test),
                      body=list(loop.orelse) + [ast.Break()], orelse=[])
        new = ast.For(target=ast.Name(id="__flor_i", ctx=ast.Store()),
                      iter=_call("loop", _call("count"), ast.Constant(value=key), *extra),
                      body=resume + [test] + loop.body, orelse=[], type_comment=None)
        return [_at(ast.copy_location(new, loop), line)]

    def _carried(self, loop, scope):
        """(names, paths, globals, rebound, iterated): what the loop's body carries
        into its next iteration, or None if analysis gives up.  Only what an
        iteration hands to the next: names the body reads before it assigns
        them (never one the header binds) and objects reached through them
        (program/liveness.py)."""
        try:
            eff = block_effects(self.script, loop.body, scope)
        except GiveUp:
            return None
        header = target_names(loop.target) if isinstance(loop, ast.For) else set()
        live = self._live(loop, header, scope)
        keep = live - header
        names, paths, globals_ = self._sets(eff, scope)
        # := binds names the side-effect analysis of statements does not see.
        bindable = _bindable(scope)
        names += sorted(n for n in {x.target.id for x in walk_scope(loop.body)
                                    if isinstance(x, ast.NamedExpr)} - set(names) - header
                        if bindable is None or n in bindable)
        return ([n for n in names if n in keep], [p for p in paths if root(p) in keep],
                globals_, [p for p in eff.paths if p in eff.assigned and root(p) in keep],
                sorted(p for p in eff.iterated if root(p) in keep))

    def _live(self, loop, header, scope) -> set[str]:
        """Names whose value one iteration of `loop` may hand to what comes
        after it (program/liveness.py): read before assigned (a while loop's
        condition is read at the top of the body, after a restore), assigned
        on some paths only, or read by a function or lambda of the script."""
        body = loop.body
        live = exposed(body, header) | function_reads(self.tree, scope)
        if isinstance(loop, ast.While):
            live |= reads(loop.test)
        exits = any(isinstance(n, (ast.Break, ast.Continue, ast.Return, ast.Raise))
                    for n in walk_scope(body))
        made = set() if exits else definite(body, header)
        return live | (assigned_names(body) - made)

    def _sets(self, eff, scope):
        """(names rebound by the instrumented code, paths set in place or
        by the runtime, module globals) of a side-effect set."""
        bindable = _bindable(scope)
        names, paths, globals_ = [], [], list(eff.globals)
        for p in eff.paths:
            if p != root(p):
                paths.append(p)
            elif bindable is None or p in bindable:
                names.append(p)  # rebound by the end() statement
            elif p in self.script.module_names:
                globals_.append(p)  # a module global the function only reads
            else:
                paths.append(p)  # a closure's variable: restored in place only
        return names, paths, globals_

    # -- blocks ---------------------------------------------------------------

    def _main_body(self, stmts, owner, scope):
        out = []
        for s in stmts:
            if isinstance(s, LOOPS) or isinstance(s, ast.AsyncFor):
                out.extend(self._block(s, "loop", owner, scope))
            elif self._loop_call(s, scope):
                out.extend(self._block(s, "call", owner, scope))
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append(s)
            else:
                _rewrite_bodies(s, lambda b: self._main_body(b, owner, scope))
                out.append(s)
        return out

    def _loop_call(self, s, scope) -> bool:
        """`f(...)` or `targets = f(...)` where f is a function of the script
        that runs a loop, or a method of the script's class of which the
        receiver is an instance (``self.train_epoch(epoch)``, ``trainer.fit()``)."""
        value = s.value if isinstance(s, (ast.Expr, ast.Assign, ast.AugAssign,
                                          ast.AnnAssign)) else None
        if not isinstance(value, ast.Call):
            return False
        fn = self.script.resolve(value, scope)
        return fn is not None and self.script.has_loop(fn)

    def _block(self, s, kind, owner, scope):
        line = s.lineno
        if self.opted_out(s):
            self.out.left_alone.append((line, "# flor: skip"))
            return [s]
        try:
            eff = block_effects(self.script, [s], scope)
        except GiveUp as e:
            self.out.left_alone.append((line, f"analysis gave up: {e}"))
            return [s]
        key = self.key_of(line)
        names, paths, globals_ = self._sets(eff, scope)
        rebound = [p for p in eff.paths if p in eff.assigned]
        grads = gradients_live(s, self.loop_body, lambda call: self.script.resolve(
            call, scope), self.schedulers)
        self.out.blocks.append(Block(
            key=key, line=line, end_line=s.end_lineno, owner=owner, kind=kind, names=names,
            paths=paths, globals=globals_, rebound=rebound, dropped=eff.dropped,
            unknown=eff.unknown, calls=sorted(called_names([s]) | eff.calls),
            reads=sorted(eff.reads),
            grads=grads))
        # An iterator the block advances is of no account where nothing reads
        # it after the block (`it = iter(loader)` at the top of each epoch).
        live = self.after_block | _loads_outside(self.loop_body, s)
        dead = [p for p in names + paths if root(p) not in live]
        # What it loops over, and what reads after it: an iterator there is
        # advanced by the block, and no checkpoint of the block holds it.
        iterated = sorted(p for p in eff.iterated if root(p) in live)
        sets = [_strs(names), _strs(paths), _strs(globals_), _strs(rebound)]
        guarded = ast.If(
            test=_call("step_into", ast.Constant(value=key), ast.Constant(value=owner), *sets,
                       _strs(dead), _strs(iterated)),
            body=[ast.Try(body=[s], handlers=[ast.ExceptHandler(
                type=ast.Name(id="BaseException", ctx=ast.Load()), name=None,
                body=[ast.Expr(value=_call("abandon")), ast.Raise(exc=None, cause=None)])],
                orelse=[], finalbody=[])],
            orelse=[])
        end = _call("end", ast.Constant(value=key), *[_strs(x) for x in
                                                    (names, paths, globals_, rebound)],
                    ast.Constant(value=grads), _strs(dead), _strs(iterated))
        if names:
            after = ast.Assign(targets=[ast.Tuple(
                elts=[ast.Name(id=n, ctx=ast.Store()) for n in names], ctx=ast.Store())],
                value=end, type_comment=None)
        else:
            after = ast.Expr(value=end)
        return [_at(guarded, line), _at(after, s.end_lineno)]


def _loads_outside(where, node) -> set[str]:
    """Names read in `where` (a scope: its body; or a list of statements)
    outside `node`, not entering nested functions."""
    stmts = where if isinstance(where, list) else where.body
    stack, out = list(stmts), set()
    while stack:
        n = stack.pop()
        if n is node:
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(n))
    return out


def _bindable(scope):
    """Names a function may rebind (its locals, and what it declares global
    or nonlocal); None at module level, where every name is."""
    if isinstance(scope, ast.Module):
        return None
    a = scope.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    names |= assigned_names(scope.body)
    for n in walk_scope(scope.body):
        if isinstance(n, (ast.Global, ast.Nonlocal)):
            names |= set(n.names)
    return names


def _q(prefix, name):
    return name if prefix == "<module>" else f"{prefix}.{name}"


def instrument(source: str, filename: str, key_of, modules=None,
               imported=False) -> Instrumented:
    """Instrument `source`; `key_of(line)` names the loop or block at a line;
    `modules` (analysis.Modules): the project's modules whose functions the
    analysis follows calls into; `imported`: a module the script imports,
    whose loops at module level (they run as it is imported) are left as
    they are."""
    return _Instrumenter(source, filename, key_of, modules, imported).run(filename)
