"""Why a replay's values differ from the record's: every likely-cause
heuristic of the deferred checks, in one place.

- A printed line that differs from the recorded one only in fields whose
  values come from the clock (an expression that calls time.time(),
  perf_counter(), datetime.now() ..., or reads a variable computed from
  one, in any function of the script) is not a failure: it is set apart as
  "reads the clock".  Its other fields are compared: the statement's
  f-strings and print() arguments give the fields; a line whose fields
  cannot be told apart is compared whole.
- State fingerprints tell where replay first diverged: a block that ran
  again and ended in another state, or an iteration whose end state differs
  although every block that ran again in it ended as in record (then a
  block restored in it did not hold everything it changes).
- The random state at the start of a loop differed: the script draws
  unseeded random numbers (named only when something else differs: a
  script may leave a generator it never uses unseeded).
- A re-executed block ran with another torch thread count than the record.
- The record ran CUDA kernels without deterministic algorithms.
- For a statement that differs: the block restored before it may miss a
  path the statement reads (hands-free), or flor's blocks are not involved.
"""
from __future__ import annotations

import ast
import builtins
import json
import os
import re
import string

from ..context import parse_location
from ..program.analysis import Script
from ..program.syntax import path_of, root
from .checks import STATE, equal

__all__ = ["explain", "clock_names"]

_BUILTINS = set(dir(builtins))
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


def clock_names(tree) -> set[str]:
    """Names assigned, anywhere in the script, from an expression that reads
    the clock or another such name (to a fixpoint)."""
    assigns = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names = {t.id for tt in targets for t in ast.walk(tt) if isinstance(t, ast.Name)}
            assigns.append((names, n.value, {x.id for x in ast.walk(n.value)
                                             if isinstance(x, ast.Name)}))
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


def _reads_clock(stmt, text, tainted) -> bool:
    if stmt is None:
        return False
    if _calls_clock(stmt) or _CLOCK.search(text):
        return True
    return any(isinstance(n, ast.Name) and n.id in tainted for n in ast.walk(stmt))


def _reads_clock_expr(expr, tainted) -> bool:
    """Whether an expression reads the clock."""
    return (_calls_clock(expr) or bool(_CLOCK.search(ast.unparse(expr)))
            or any(isinstance(n, ast.Name) and n.id in tainted for n in ast.walk(expr)))


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


def _clock_fields_only(stmt, tainted, recorded, replayed, tolerance) -> bool:
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


def _statement_at(tree, line):
    best = None
    for n in ast.walk(tree):
        if isinstance(n, ast.stmt) and n.lineno <= line <= (n.end_lineno or n.lineno):
            if best is None or n.lineno >= best.lineno:
                best = n
    return best


def _paths_read(stmt):
    """Objects a statement reads: not the functions it calls, not builtins."""
    called = {id(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
    out = set()
    for n in ast.walk(stmt):
        if id(n) in called and isinstance(n, ast.Name):
            continue
        if isinstance(n, ast.Name) and n.id in _BUILTINS:
            continue
        if id(n) in called and isinstance(n, ast.Attribute):
            n = n.value  # x.method(): the object read is x
        if isinstance(n, (ast.Attribute, ast.Name)) and isinstance(n.ctx, ast.Load):
            p = path_of(n)
            if p is not None:
                out.add(p)
    return out


class _Program:
    """The edited script as the heuristics need it."""

    def __init__(self, source):
        try:
            self.tree = ast.parse(source)
        except SyntaxError:
            self.tree = None
        self.lines = source.splitlines()
        self.not_state = Script(self.tree).not_state if self.tree is not None else set()
        self.clock = clock_names(self.tree) if self.tree is not None else set()

    def statement(self, line):
        stmt = _statement_at(self.tree, line) if self.tree is not None else None
        text = "\n".join(self.lines[stmt.lineno - 1:stmt.end_lineno]) if stmt else ""
        return stmt, text


def explain(report, store, plan, source, rec=None):
    """Fill report.shown_loc (current file:line of each statement), set apart
    clock-only differences (report.clock), and fill report.causes (a likely
    cause per statement that differed) and report.run_causes (causes that
    concern the whole replay)."""
    back = {rel: {v: k for k, v in lines.items()} for rel, (lines, _) in plan.line_maps().items()}
    prog = _Program(source)
    script = os.path.basename(plan.script)

    def current(loc):
        rel, line, new = parse_location(loc)
        cur = line if new else back.get(rel, {}).get(line) if line is not None else None
        report.shown_loc[loc] = f"{rel}:{cur}" if cur else loc
        return rel, cur

    # Differences only in fields that read the clock are not failures.
    for m in list(report.mismatches):
        loc, name, _, _, recorded, replayed = m
        if name.startswith(STATE):
            continue
        rel, cur = current(loc)
        if cur is None or rel != script:
            continue
        stmt, text = prog.statement(cur)
        if _reads_clock(stmt, text, prog.clock) and \
                _clock_fields_only(stmt, prog.clock, recorded, replayed, plan.tolerance or 0.0):
            report.mismatches.remove(m)
            report.clock.append(m)
    states = [m for m in report.mismatches if m[1].startswith(STATE)]
    values = [m for m in report.mismatches + report.missing if not m[1].startswith(STATE)]
    blockruns = store.run_rows("blockruns", plan.replay_id)
    parts = store.rows("parts", plan.replay_id)
    for loc in {m[0] for m in values}:
        rel, cur = current(loc)
        if cur is None or rel != script:
            continue
        report.causes[loc] = _statement_cause(report, prog, cur, rel, plan, blockruns, parts)
        if report.causes[loc] is None:
            del report.causes[loc]
    for m in states:
        current(m[0])
    if states:
        report.run_causes.append(_state_cause(states, blockruns))
    if report.mismatches or report.missing:
        for cause in (_random_cause(report, source), _thread_cause(rec, parts, blockruns),
                      _gpu_cause(rec, plan.tolerance)):
            if cause:
                report.run_causes.append(cause)


_USES = {"torch": None, "numpy": re.compile(r"\b(np|numpy)\.random\b"),
         "random": re.compile(r"^\s*(import random|from random import)", re.M)}


def _random_cause(report, source):
    """Generators whose state at a loop's start differed between the runs:
    torch's (models draw from it), and numpy's or random's when the script
    uses them."""
    for loc, recorded, replayed in report.random:
        differ = sorted(g for g in recorded if recorded[g] != replayed.get(g)
                        and (_USES.get(g) is None or _USES[g].search(source)))
        if differ:
            return (f"the global random state of {' and '.join(differ)} differed between the "
                    f"record and the replay where the loop at {loc} starts: if the script "
                    "draws such random numbers, it draws them without a fixed seed (seed them "
                    "at its start: torch.manual_seed(0), numpy.random.seed(0), random.seed(0))")
    return None


def _state_cause(states, blockruns) -> str:
    """Where the state first diverged, from the fingerprints."""
    first = min(states, key=lambda m: (json.loads(m[2])[:1], m[1] != "state@block"))
    loc, name, ctx = first[:3]
    frames = json.loads(ctx)
    where = (f"iteration {frames[0][3]} of the loop at {frames[0][1]}"
             if frames and frames[0][0] == "L" else "the top level")
    if name == "state@block":
        return (f"block {loc} ran again at {where} and ended in another state than in record: "
                "its computation is not deterministic (unseeded random numbers, the thread "
                "count, GPU kernels) or it reads state that changed before it")
    top = json.dumps(frames[:1], separators=(",", ":"))[:-1]
    restored = sorted({b["block"] for b in blockruns if b["state"] in ("skip", "pseudoresume")
                       and b["ctx"].startswith(top)})
    if restored:
        one = len(restored) == 1
        return (f"the state at the end of {where} differs from the record's, though every "
                f"block that ran again in it ended as in record: the block{'' if one else 's'} "
                f"restored in it ({', '.join(restored)}) may not hold everything "
                f"{'it changes' if one else 'they change'}, such as gradients or state in "
                "another module")
    return (f"the state at the end of {where} differs from the record's: code outside flor's "
            "blocks changed it differently (nondeterminism, other processes or files)")


def _gpu_cause(rec, tolerance):
    """Named when the record ran CUDA kernels without asking torch for
    deterministic algorithms."""
    info = json.loads(rec["info"] or "{}") if rec is not None else {}
    if not info.get("cuda") or info.get("deterministic"):
        return None
    fix = ("a larger --tolerance" if tolerance else "compare with --tolerance REL (1e-4, say)")
    return ("the record ran on a GPU without deterministic algorithms: CUDA kernels (cuBLAS, "
            "the atomic adds of some backward passes) differ from run to run in their last "
            f"bits, so code that ran again ends near the record's state, not at it; {fix}, "
            "or record again with torch.use_deterministic_algorithms(True) at the script's "
            "start and CUBLAS_WORKSPACE_CONFIG=:4096:8 in its environment")


def _thread_cause(rec, parts, blockruns):
    """Named only when a block ran again with another thread count."""
    if rec is None:
        return None
    rec_threads = json.loads(rec["info"] or "{}").get("threads")
    ran = {b["part"] for b in blockruns if b["state"] == "step_into"}
    used = {json.loads(p["info"] or "{}").get("threads") for p in parts if p["part"] in ran}
    used.discard(None)
    if rec_threads is None or not used - {rec_threads}:
        return None
    return (f"blocks ran again with torch using {sorted(used)} intra-op threads, the record "
            f"with {rec_threads}; CPU results match bit for bit only with the same thread "
            "count (set it in the script with torch.set_num_threads)")


def _statement_cause(report, prog, cur, rel, plan, blockruns, parts):
    """The likely cause of a difference in the statement at line `cur`."""
    stmt, text = prog.statement(cur)
    if _reads_clock(stmt, text, prog.clock):
        return "the statement reads the clock, so its values differ between runs"
    hands_free = plan.hands_free or {}
    restored = {b["block"] for b in blockruns if b["state"] in ("skip", "pseudoresume")}
    blocks = [b for b in hands_free.get("blocks", []) if b["key"] in restored]
    before = [b for b in blocks if b["line"] < cur] or blocks
    if not before:
        if not hands_free:
            return None
        return ("no block was restored before it: the difference comes from outside "
                "flor's blocks (nondeterminism, the clock, other processes or files)")
    captured = {}  # block -> what the replay captured, completion included
    for part in parts:
        for key, labels in (json.loads(part["info"] or "{}").get("captured") or {}).items():
            for label in labels:
                for name in label.split(":", 1)[0].split(", "):
                    captured.setdefault(key, set()).add(name.removeprefix("global "))
    b = max(before, key=lambda b: b["line"])
    held = sorted(set(b["names"] + b["paths"] + b["globals"]) | captured.get(b["key"], set()))
    suspects = []
    for p in sorted(_paths_read(stmt)) if stmt else []:
        r = root(p)
        if r not in b["reads"] or (p == r and r in prog.not_state):
            continue
        if any(p == h or p.startswith(h + ".") or p.startswith(h + "[") for h in held):
            continue
        if any(q != p and q.startswith(p + ".") for q in _paths_read(stmt) if root(q) == r):
            continue  # report the longest path read
        suspects.append(p)
    where = f"{rel}:{b['line']}"
    if suspects:
        return (f"the side-effect set of the block at {where} may be "
                f"missing {', '.join(f'`{x}`' for x in suspects)}")
    return (f"the side-effect set of the block at {where} (restored from a checkpoint) "
            f"may be incomplete; it holds {', '.join(held) or 'only the random state'}. "
            "State changed where flor cannot see it (another module's code, a C "
            "extension) is not captured")
