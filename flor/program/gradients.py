"""Whether a block leaves parameters' gradients that later code reads.

Gradients are state that no state_dict() holds.  A block that calls
``backward()`` leaves them in the parameters' ``.grad``; whether they
matter depends on what runs next.  In gradient accumulation the optimizer
steps after the micro-step loop, so the block's gradients are *live*:

    for it in range(max_iters):
        for micro in range(accum):        # the block
            model(X, Y).backward()
        optimizer.step()                  # reads the gradients: live
        optimizer.zero_grad()

In an ordinary training loop the next block clears them before reading
them (``zero_grad()`` first), so they are dead and cost nothing.

The statements after the block in its loop's body are scanned in source
order, then (the loop goes round) those before it, entering the functions
of the script that they call, for the first *gradient event*:

    read    .grad loaded; backward() (it adds to them); optimizer or scaler
            step(); unscale_(); clip_grad_norm_() / clip_grad_value_()
    clear   zero_grad(); ``p.grad = None``

The gradients are live when the first event is a read.  A ``step()`` is an
optimizer's unless its receiver is named or built like a learning-rate
scheduler.
"""
from __future__ import annotations

import ast

from .syntax import bodies, path_of, simple_statements, walk_scope

__all__ = ["makes_gradients", "gradients_live", "loop_gradients_live", "manual_gradients",
           "manual_loop_gradients", "scheduler_names"]

_CLIPS = {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"}
_SCHEDULERS = ("lr_scheduler", "Scheduler", "LR", "Plateau", "Annealing", "Warmup")


def scheduler_names(tree) -> set[str]:
    """Paths assigned a learning-rate scheduler (``scheduler = StepLR(...)``,
    ``self.sched = torch.optim.lr_scheduler.OneCycleLR(...)``)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            name = ast.unparse(n.value.func)
            last = name.rsplit(".", 1)[-1]
            if "lr_scheduler" in name or any(last.endswith(s) for s in _SCHEDULERS[1:]):
                for t in n.targets:
                    p = path_of(t)
                    if p is not None:
                        out.add(p)
    return out


def _is_scheduler(receiver, schedulers) -> bool:
    if receiver is None:
        return False
    last = receiver.rsplit(".", 1)[-1].lower()
    return receiver in schedulers or "sched" in last or last in ("lr", "warmup")


def _event(node, schedulers):
    """The gradient event of one expression node, or None."""
    if isinstance(node, ast.Attribute) and node.attr == "grad" and isinstance(node.ctx, ast.Load):
        return "read"
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else (
            func.id if isinstance(func, ast.Name) else None)
        if name == "zero_grad":
            return "clear"
        if name in ("backward", "unscale_") or name in _CLIPS:
            return "read"
        if name == "step" and isinstance(func, ast.Attribute) and \
                not _is_scheduler(path_of(func.value), schedulers):
            return "read"
    return None


def _statement_event(stmt, resolve, schedulers, seen, enter=None):
    """The first gradient event of a simple statement: its own expressions
    in evaluation order, and the bodies of the script's functions it calls
    (their first event, or what `enter(fn, seen)` says of them)."""
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "grad" and \
                    isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
                return "clear"
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return None
    for node in _own_walk(stmt):
        event = _event(node, schedulers)
        if event is not None:
            return event
        if isinstance(node, ast.Call):
            fn = resolve(node)
            if fn is not None and fn not in seen:
                event = enter(fn, seen | {fn}) if enter is not None else \
                    first_event(fn.body, resolve, schedulers, seen | {fn})
                if event is not None:
                    return event
    return None


def _own_walk(stmt):
    """The nodes of a statement's own expressions (not its body), calls'
    arguments before the calls themselves, as Python evaluates them."""
    from .syntax import own_nodes

    out = []

    def post(node):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                      ast.Lambda)):
                post(child)
        out.append(node)
    for node in own_nodes(stmt):
        post(node)
    return out


def first_event(stmts, resolve, schedulers, seen=frozenset()):
    """The first gradient event of `stmts`, in source order, or None."""
    for s in simple_statements(stmts):
        event = _statement_event(s, resolve, schedulers, seen)
        if event is not None:
            return event
    return None


def makes_gradients(stmts, resolve) -> bool:
    """Whether `stmts` call backward(), directly or in a function of the
    script they call."""
    seen, todo = set(), [list(stmts)]
    while todo:
        for node in walk_scope(todo.pop()):
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "backward":
                    return True
                fn = resolve(node)
                if fn is not None and fn not in seen:
                    seen.add(fn)
                    todo.append(list(fn.body))
    return False


def gradients_live(block, loop_body, resolve, schedulers, end=None) -> bool:
    """Whether the gradients `block` (a statement inside `loop_body`, a
    loop's body) leaves are read before they are cleared: by the statements
    after it (after `end`, a statement that follows it, when given), then,
    the loop going round, those before it."""
    if not makes_gradients([block], resolve):
        return False
    last = end if end is not None else block
    inside = {id(n) for s in (block, last) for n in ast.walk(s)}
    flat = list(simple_statements(loop_body))
    at = next((i for i, s in enumerate(flat) if s is block), None)
    stop = next((i for i, s in enumerate(flat) if s is last), None)
    if at is None or stop is None:
        return False
    after = [s for s in flat[stop + 1:] if id(s) not in inside]
    before = flat[:at]
    for part in (after, before):
        for s in part:
            event = _statement_event(s, resolve, schedulers, frozenset())
            if event is not None:
                return event == "read"
    return False


def loop_gradients_live(loop_body, resolve, schedulers) -> bool:
    """Whether the gradients one iteration of a loop leaves are read by the
    next iteration before they are cleared: gradient accumulation over the
    loop's own iterations, where backward() runs every iteration and the
    optimizer steps every k-th (Accelerate's ``accumulate()``, or an
    ``if (i + 1) % k == 0`` around step() and zero_grad()).  They are, when
    a read comes before any clear that surely runs: a clear under an
    ``if``, in a loop or a ``try``, or in Accelerate's ``accumulate()``
    (whose optimizer acts only at the window's end) may not run.  A loop
    that clears first (``zero_grad()``, then backward() and step()) leaves
    none that matter."""
    return makes_gradients(loop_body, resolve) and \
        _sure_event(loop_body, resolve, schedulers, False, frozenset()) == "read"


def _sure_event(stmts, resolve, schedulers, maybe, seen):
    """"read" if `stmts` may read the gradients before a clear that surely
    runs, "clear" if such a clear comes first (never where `maybe`: the
    statements run only sometimes), else None; the script's functions they
    call (not in `seen`) are entered, their statements as sure as the call."""
    for s in stmts:
        if isinstance(s, ast.If):
            a = _sure_event(s.body, resolve, schedulers, maybe, seen)
            b = _sure_event(s.orelse, resolve, schedulers, maybe, seen)
            event = "read" if "read" in (a, b) else "clear" if a == b == "clear" else None
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            event = _sure_event(s.body, resolve, schedulers, maybe or _accumulates(s), seen)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            event = None
        elif bodies(s):  # a loop, a try, a match: it may not run, or not all of it
            # A loop's body (a try's) runs in order when it runs: its first
            # sure event decides for it; its other parts may not run.
            first, *rest = [[x for part in body for x in
                             (part.body if hasattr(part, "pattern") or
                              isinstance(part, ast.excepthandler) else [part])]
                            for _, body in bodies(s)]
            if isinstance(s, ast.Match if hasattr(ast, "Match") else ()):
                first, rest = [], [first, *rest]
            events = [_sure_event(first, resolve, schedulers, maybe, seen)] + \
                [_sure_event(r, resolve, schedulers, True, seen) for r in rest]
            event = "read" if "read" in events else None
        else:  # a function of the script it calls: as sure as the call
            event = _statement_event(s, resolve, schedulers, seen, lambda fn, inner: _sure_event(
                fn.body, resolve, schedulers, maybe, inner))
        if event == "read" or (event == "clear" and not maybe):
            return event
    return None


def _accumulates(stmt) -> bool:
    """A ``with`` of Accelerate's ``accumulate()`` (or a DDP ``no_sync()``)."""
    return any(isinstance(i.context_expr, ast.Call) and
               isinstance(i.context_expr.func, ast.Attribute) and
               i.context_expr.func.attr in ("accumulate", "no_sync") for i in stmt.items)


def manual_loop_gradients(source: str, rel: str) -> set[str]:
    """The keys of the manual API's main loops (``for ... in
    flor.generator(...)``) in `source` (the file `rel`) whose iterations
    carry gradients to the next (loop_gradients_live)."""
    from ..context import location
    from .analysis import Script
    from .source import is_flor_call, literal_arg

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    script, schedulers = Script(tree), scheduler_names(tree)
    return {literal_arg(loop.iter, 1, "name") or location(rel, loop.iter.lineno)
            for loop in ast.walk(tree)
            if isinstance(loop, (ast.For, ast.AsyncFor)) and is_flor_call(loop.iter, "generator")
            and loop_gradients_live(loop.body, lambda call: script.resolve(call, tree),
                                    schedulers)}


def manual_gradients(source: str, rel: str) -> set[str]:
    """The keys of the manual API's blocks in `source` (the file `rel`) whose
    gradients are read after their SkipBlock.end() call."""
    from ..context import location
    from .analysis import Script
    from .source import is_flor_call, literal_arg
    from .syntax import bodies

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    script, schedulers = Script(tree), scheduler_names(tree)
    out = set()
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.While, ast.AsyncFor)):
            continue
        todo = [loop.body]
        while todo:
            stmts = todo.pop()
            for i, stmt in enumerate(stmts):
                if isinstance(stmt, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef,
                                     ast.AsyncFunctionDef, ast.ClassDef)):
                    continue  # an inner loop is a loop of its own
                for _, subs in bodies(stmt):  # if, with, try: their statement lists
                    if isinstance(subs[0], ast.stmt):
                        todo.append(subs)
                    else:
                        todo.extend(part.body for part in subs)  # handlers, cases
                if not (isinstance(stmt, ast.If) and is_flor_call(stmt.test, "step_into")):
                    continue
                end = next((s for s in stmts[i + 1:]
                            if any(is_flor_call(n, "end") for n in ast.walk(s))), None)
                if end is not None and gradients_live(
                        stmt, loop.body, lambda call: script.resolve(call, tree), schedulers, end):
                    out.add(literal_arg(stmt.test, 0, "name") or location(rel, stmt.test.lineno))
    return out
