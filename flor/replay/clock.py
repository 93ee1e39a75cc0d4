"""Which fields of a printed line come from the clock.

A printed line that differs from the recorded one only in fields whose
values come from the clock (an expression that calls time.time(),
perf_counter(), datetime.now() ..., or reads a variable computed from one,
in any function of the script) is not a failure of the deferred checks.
Its other fields are compared: the statement's f-strings, str.format and
%-format arguments, print() arguments and + concatenations give the
fields, with the numbers around them pinned; a line whose fields cannot
be told apart is compared whole.

A printed dict whose values differ only under the keys the Hugging Face
Trainer fills from the clock (``train_runtime``, ``eval_samples_per_second``
...: its speed metrics, which it prints itself and returns from
``evaluate``) is not a failure either; its other values are compared.
"""
from __future__ import annotations

import ast
import json
import re
import string

from .checks import equal

__all__ = ["clock_names", "reads_clock", "clock_fields_only", "speed_metrics_only"]

_CLOCK = re.compile(r"\btime\b|perf_counter|monotonic|datetime|elapsed|\bnow\(")
_CLOCK_CALLS = {"time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic",
                "monotonic_ns", "process_time", "now", "utcnow", "today"}


def _calls_clock(node) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in _CLOCK_CALLS:
                return True
    return False


def _assigned(target) -> set[str]:
    """What an assignment target taints: a name; ``.attr`` for an attribute
    (``self.iter_dt = ...``: any object's iter_dt, not the object); a
    container for an item."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Attribute):
        return {"." + target.attr}
    if isinstance(target, (ast.Tuple, ast.List)):
        return {x for elt in target.elts for x in _assigned(elt)}
    if isinstance(target, ast.Starred):
        return _assigned(target.value)
    if isinstance(target, ast.Subscript):
        return {n.id for n in ast.walk(target.value) if isinstance(n, ast.Name)}
    return set()


def _read(node) -> set[str]:
    return {x.id for x in ast.walk(node) if isinstance(x, ast.Name)} | {
        "." + x.attr for x in ast.walk(node) if isinstance(x, ast.Attribute)}


def _tainted(node, tainted) -> bool:
    return any((isinstance(n, ast.Name) and n.id in tainted)
               or (isinstance(n, ast.Attribute) and "." + n.attr in tainted)
               for n in ast.walk(node))


def clock_names(tree) -> set[str]:
    """Names assigned, anywhere in the file, from an expression that reads
    the clock or another such name (to a fixpoint); ``.attr`` for an
    attribute so assigned (the trainer module's ``self.iter_dt``, which the
    script's callback prints as ``trainer.iter_dt``)."""
    assigns = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names = set().union(*(_assigned(t) for t in targets))
            assigns.append((names, n.value, _read(n.value)))
    tainted = set()
    for names, value, _ in assigns:
        if _calls_clock(value):
            tainted |= names
    grew = True
    while grew:
        grew = False
        for names, _, reads in assigns:
            if reads & tainted and not names <= tainted:
                tainted |= names
                grew = True
    return tainted


def reads_clock(stmt, text, tainted) -> bool:
    if stmt is None:
        return False
    if _calls_clock(stmt) or _CLOCK.search(text):
        return True
    return _tainted(stmt, tainted)


def _reads_clock_expr(expr, tainted) -> bool:
    """Whether an expression reads the clock."""
    return (_calls_clock(expr) or bool(_CLOCK.search(ast.unparse(expr)))
            or _tainted(expr, tainted))


_PACKS = (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.JoinedStr)
_CLOCK_TEXT = r"\s*([-+]?(?:\d[\d.:eE+-]*|\.\d[\d.eE+-]*|nan|inf))\s*"


def _clock_field(expr, tainted) -> bool:
    """Whether a printed field's value comes from the clock: it reads the
    clock, and packs no other value into its text (a tuple, an f-string, %
    or .format(), a call that also takes a value not from the clock), which
    would then go uncompared.  Arithmetic with other numbers (per batch,
    in ms) still comes from the clock."""
    for n in ast.walk(expr):
        if isinstance(n, _PACKS) or (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)
                                     and isinstance(n.left, (ast.Constant, ast.JoinedStr))):
            return False
        name = getattr(n.func, "attr", getattr(n.func, "id", None)) \
            if isinstance(n, ast.Call) else None
        if isinstance(n, ast.Call) and name not in _CLOCK_CALLS and not all(
                isinstance(a, ast.Constant) or _reads_clock_expr(a, tainted)
                for a in n.args + [k.value for k in n.keywords]):
            return False
    return _reads_clock_expr(expr, tainted)


_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")


def _format_pieces(fmt, args, keywords) -> list | None:
    """str.format: the literal text and each field's argument."""
    out, auto = [], 0
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return None
    for literal, field, spec, _ in parsed:
        out.append(literal)
        if field is None:
            continue
        if spec and "{" in spec:
            return None
        head = re.match(r"[^.\[]*", field).group(0)
        if head == "":
            head, auto = str(auto), auto + 1
        if head.isdigit():
            if int(head) >= len(args):
                return None
            out.append(args[int(head)])
        elif head in keywords:
            out.append(keywords[head])
        else:
            return None
    return out


def _percent_pieces(fmt, right) -> list | None:
    """printf-style %: the literal text and each specifier's argument."""
    values = right.elts if isinstance(right, ast.Tuple) else [right]
    out, pos, i = [], 0, 0
    for m in _PERCENT.finditer(fmt):
        out.append(fmt[pos:m.start()])
        pos = m.end()
        if m.group(1) == "%":
            out.append("%")
            continue
        if "(" in m.group(0) or "*" in m.group(0) or i >= len(values):
            return None
        out.append(values[i])
        i += 1
    return out + [fmt[pos:]] if i == len(values) else None


def _pieces(arg) -> list | None:
    """What one argument prints: literal strings and formatted expressions."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr):  # literal strings and FormattedValues' expressions
        return [v.value for v in arg.values]
    if isinstance(arg, ast.Starred):
        return None
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and \
            arg.func.attr == "format" and isinstance(arg.func.value, ast.Constant) and \
            isinstance(arg.func.value.value, str):
        if any(isinstance(a, ast.Starred) for a in arg.args) or \
                any(k.arg is None for k in arg.keywords):
            return None
        return _format_pieces(arg.func.value.value, arg.args,
                              {k.arg: k.value for k in arg.keywords})
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Mod) and \
            isinstance(arg.left, ast.Constant) and isinstance(arg.left.value, str):
        return _percent_pieces(arg.left.value, arg.right)
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add) and _is_text(arg):
        left, right = _pieces(arg.left), _pieces(arg.right)  # "took " + str(dt)
        return None if left is None or right is None else left + right
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "str" \
            and len(arg.args) == 1 and not arg.keywords:
        return [arg.args[0]]
    return [arg]


def _is_text(node) -> bool:
    """Whether a + of strings: one side is a literal string, an f-string or str()."""
    return any(isinstance(n, (ast.JoinedStr,)) or (isinstance(n, ast.Constant) and
                                                   isinstance(n.value, str)) or
               (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "str")
               for n in (node.left, node.right))


def _template(stmt) -> list | None:
    """The text a statement prints, as literal strings and the expressions
    formatted between them: print(...), and a call of one formatted string
    (a logger's, tqdm.write's); f-strings, str.format and %.  None where the
    fields cannot be told apart."""
    call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
    if call is None:
        return None
    if isinstance(call.func, ast.Name) and call.func.id == "print":
        sep = " "
        for kw in call.keywords:
            if kw.arg == "sep" and isinstance(kw.value, ast.Constant) and \
                    isinstance(kw.value.value, str):
                sep = kw.value.value
            elif kw.arg == "sep" and not (isinstance(kw.value, ast.Constant)
                                          and kw.value.value is None):
                return None
        out = []
        for i, arg in enumerate(call.args):
            pieces = _pieces(arg)
            if pieces is None:
                return None
            out += ([sep] if i else []) + pieces
        return out
    if len(call.args) > 1 and isinstance(call.args[0], ast.Constant) and \
            isinstance(call.args[0].value, str) and "%" in call.args[0].value and \
            not any(isinstance(a, ast.Starred) for a in call.args):
        # logger.info("epoch %d took %.2fs", epoch, dt): % formatting of the rest
        return _percent_pieces(call.args[0].value, ast.Tuple(elts=call.args[1:], ctx=ast.Load()))
    if len(call.args) == 1 and isinstance(call.args[0], (ast.JoinedStr, ast.Call, ast.BinOp)):
        pieces = _pieces(call.args[0])
        return pieces if pieces is not None and pieces != [call.args[0]] else None
    return None


def clock_fields_only(stmt, tainted, recorded, replayed, tolerance) -> bool:
    """Whether a value printed by `stmt` differs from the recorded one only
    in fields whose values come from the clock."""
    a, b = json.loads(recorded), json.loads(replayed)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return _reads_clock_expr(stmt, tainted)  # the number logged is the clock's
    template = _template(stmt) if isinstance(a, str) and isinstance(b, str) else None
    if template is None:
        return False
    # A clock field is one number (padded), pinned between the literals, so
    # that no other value's text can shift into it; the other fields are one
    # word each where both lines read so (padded numbers), else any text.
    fields = [None if isinstance(p, str) else _clock_field(p, tainted) for p in template]
    for other in (r"\s*(\S+?)\s*", "(.*?)"):
        pattern = re.compile("".join(re.escape(p) if c is None else _CLOCK_TEXT if c else other
                                     for p, c in zip(template, fields)), re.S)
        ma, mb = pattern.fullmatch(a.rstrip("\n")), pattern.fullmatch(b.rstrip("\n"))
        if ma is not None and mb is not None:
            return all(c or equal(x, y, tolerance) for c, x, y in
                       zip([c for c in fields if c is not None], ma.groups(), mb.groups()))
    return False


# The keys of the Hugging Face Trainer's speed metrics (transformers'
# speed_metrics, and the evaluation's compilation and preparation times).
_SPEED = re.compile(r"_(runtime|samples_per_second|steps_per_second|tokens_per_second|"
                    r"jit_compilation_time|model_preparation_time)$")


def _printed_dict(value):
    if not isinstance(value, str):
        return None
    try:
        d = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def speed_metrics_only(recorded, replayed, tolerance) -> bool:
    """Whether a printed line is a dict (as the Trainer prints its logs)
    whose values differ from the recorded ones only under speed-metric keys."""
    a, b = _printed_dict(json.loads(recorded)), _printed_dict(json.loads(replayed))
    if a is None or b is None or a.keys() != b.keys():
        return False
    clock = [k for k in a if isinstance(k, str) and _SPEED.search(k)]
    return bool(clock) and all(equal(a[k], b[k], tolerance) for k in a if k not in clock)
