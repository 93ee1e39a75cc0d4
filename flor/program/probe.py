"""Probe detection for hands-free replay: what the user changed, and where.

The recorded and current scripts are flattened into statements (a compound
statement contributes its header, then its body one level deeper) and
matched in order.  An added statement is a *hindsight statement* when it is
log-like: an expression statement that assigns nothing and calls ``print``,
``flor.log``, ``logging.*`` or a logger, a TensorBoard ``SummaryWriter.add_*``,
``wandb.log`` or another ``*.log*`` function, or writes to a file or a
stream (``f.write``, ``writelines``, a csv writer's ``writerow(s)``), and
that calls no in-place tensor method (``mul_``) and no method of training
state (``step``, ``zero_grad``, ``add_param_group`` ...).  Added imports are allowed too.
Everything else (assignments, control flow, changed arguments, deletions)
is an *other change*: replay warns, listing them, or refuses with --strict.

A block is stepped into when a change lies inside it, or when it calls
(directly or through other functions) a function of the script whose
definition changed, as the manual API decides (source.changed_functions);
every other block is skipped.
"""
from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

from .syntax import bodies, header, is_compound

__all__ = ["Probe", "detect", "is_log_like"]

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


def is_log_like(stmt) -> bool:
    """An expression statement that calls a logging function and assigns nothing."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    if any(isinstance(n, ast.NamedExpr) for n in ast.walk(stmt)) or state_changes(stmt):
        return False
    name = _dotted(stmt.value.func)
    if name is None:
        return False
    last = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 1)[0].lower() if "." in name else ""
    if name in ("print", "pprint", "pprint.pprint"):
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
    old = _flatten(ast.parse(old_source).body, 0, [])
    new = _flatten(ast.parse(new_source).body, 0, [])
    old_lines, new_lines = old_source.splitlines(), new_source.splitlines()
    probe = Probe()
    changed_lines = []
    sm = difflib.SequenceMatcher(None, [t for t, _, _ in old], [t for t, _, _ in new],
                                 autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        for _, node, _ in new[j1:j2]:
            line = getattr(node, "lineno", None)
            if tag == "insert" and is_log_like(node):
                probe.hindsight.append((line, _describe(node, new_lines)))
            elif tag == "insert" and state_changes(node):
                probe.other.append((line, f"changes state (calls {', '.join(state_changes(node))}"
                                          f"): {_describe(node, new_lines)}"))
            elif tag == "insert" and isinstance(node, (ast.Import, ast.ImportFrom)):
                pass  # an import for a hindsight statement
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
