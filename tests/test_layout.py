"""The source layout keeps the shape docs/ARCHITECTURE.md describes: every
module named there, Python modules and C files that depend on each other
without a circle (imports inside functions count), no mixin, no private
name imported across modules, every SQL statement in flor/store.py
(and flor/database.py).  Modules over 500 lines and classes over 250 are reported
as warnings."""
import ast
import glob
import os
import re
import shutil
import subprocess
import sysconfig
import warnings

import pytest

from conftest import ROOT

PY = sorted(glob.glob(os.path.join(ROOT, "flor", "**", "*.py"), recursive=True))
C = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c")))


@pytest.mark.unit
def test_python_module_and_class_sizes_are_reported():
    """A size is a prompt to find the concept that wants its own module, not
    a gate: over 500 lines for a module, 250 for a class, a warning."""
    for path in PY:
        with open(path) as f:
            text = f.read()
        rel = os.path.relpath(path, ROOT)
        if text.count("\n") > 500:
            warnings.warn(f"size of {rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                warnings.warn(f"size of {rel}: class {node.name}, "
                              f"{node.end_lineno - node.lineno + 1} lines")


def _modules() -> dict:
    """Dotted name -> path of every Python module of flor (C extensions too,
    with no path)."""
    mods = {}
    for path in PY:
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        mods[rel.removesuffix(".__init__")] = path
    for ext in glob.glob(os.path.join(ROOT, "flor", "_*.so")) + \
            glob.glob(os.path.join(ROOT, "flor", "_*.pyd")):
        mods["flor." + os.path.basename(ext).split(".")[0]] = None
    mods.setdefault("flor._core", None)
    return mods


def _imports(mods) -> dict:
    """Module -> the modules of flor it imports, at any depth of its code
    (an import inside a function counts)."""
    graph = {}
    for mod, path in mods.items():
        if path is None:
            continue
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        deps = set()
        with open(path) as f:
            tree = ast.parse(f.read())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - n.level + 1] + ([n.module] if n.module
                                                                         else []))
                for a in n.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
        graph[mod] = sorted(d for d in deps if d in mods and d != mod and mods[d] is not None)
    return graph


def _assert_no_circle(deps, what):
    """Depth-first search of `deps` (node -> the nodes it depends on)."""
    state = {}

    def visit(n, path):
        state[n] = "open"
        for m in sorted(deps[n]):
            assert state.get(m) != "open", f"{what} in a circle: " + " -> ".join(path + [n, m])
            if m not in state:
                visit(m, path + [n])
        state[n] = "done"
    for n in sorted(deps):
        if n not in state:
            visit(n, [])


@pytest.mark.unit
def test_python_modules_import_each_other_without_a_circle():
    _assert_no_circle(_imports(_modules()), "modules")


@pytest.mark.unit
def test_the_circle_check_sees_imports_inside_functions(tmp_path):
    """The check above can fail: a circle closed by an import in a function."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    (tmp_path / "__init__.py").write_text("")
    a.write_text("from . import b\n")
    b.write_text("def f():\n    from .a import x\n")
    graph = _imports({"p": str(tmp_path / "__init__.py"), "p.a": str(a), "p.b": str(b)})
    assert graph["p.a"] == ["p.b"] and graph["p.b"] == ["p.a"]


def _classes(paths) -> dict:
    """Class name -> [its ClassDef nodes] in the modules `paths`."""
    out = {}
    for path in paths:
        with open(path) as f:
            for n in ast.walk(ast.parse(f.read())):
                if isinstance(n, ast.ClassDef):
                    out.setdefault(n.name, []).append(n)
    return out


def _defines(cls) -> set:
    """What a class's own code defines: its methods and class attributes,
    and every `self.x` it assigns."""
    names = set()
    for st in cls.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(st.name)
        elif isinstance(st, (ast.Assign, ast.AnnAssign)):
            for t in st.targets if isinstance(st, ast.Assign) else [st.target]:
                names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
    names.update(x.attr for x in ast.walk(cls) if isinstance(x, ast.Attribute)
                 and isinstance(x.value, ast.Name) and x.value.id == "self"
                 and isinstance(x.ctx, (ast.Store, ast.Del)))
    return names


def _mixins(paths) -> list:
    """Classes that read `self.x` where neither they nor their bases define
    x: a mixin, which works only inside a class that happens to define it.
    A class with a base from outside `paths` is not judged."""
    classes = _classes(paths)
    found = []
    for name, defs in classes.items():
        for cls in defs:
            defined, bases, judged = _defines(cls), list(cls.bases), True
            while bases:
                b = bases.pop()
                if not isinstance(b, ast.Name) or b.id not in classes:
                    judged = judged and isinstance(b, ast.Name) and b.id == "object"
                    continue
                for base in classes[b.id]:
                    defined |= _defines(base)
                    bases += base.bases
            reads = {x.attr for x in ast.walk(cls) if isinstance(x, ast.Attribute)
                     and isinstance(x.value, ast.Name) and x.value.id == "self"
                     and isinstance(x.ctx, ast.Load) and not x.attr.startswith("__")}
            if judged and reads - defined:
                found.append(f"{name} reads {sorted(reads - defined)}")
    return found


@pytest.mark.unit
def test_no_class_is_a_mixin():
    """Each class defines what it reads of itself: a concept gets its own
    object (composed), not a slice of another class's attributes."""
    assert not _mixins(PY)


@pytest.mark.unit
def test_the_mixin_check_finds_a_class_that_reads_what_it_does_not_define(tmp_path):
    (tmp_path / "m.py").write_text(
        "class Base:\n    x = 1\n\n\nclass Part:\n    def f(self):\n        return self.y\n\n\n"
        "class Whole(Part):\n    def __init__(self):\n        self.y = 2\n\n\n"
        "class Fine(Base):\n    def g(self):\n        return self.x\n")
    assert _mixins([str(tmp_path / "m.py")]) == ["Part reads ['y']"]


def _private_imports(paths, modules) -> list:
    """Names starting with an underscore that a module imports from another
    module of flor, or reads as an attribute of one it imported; the
    private modules `modules` (flor._core, flor._cuda) are not such names."""
    found = []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("flor")):
                for a in n.names:
                    if a.name in modules:
                        imported.add(a.asname or a.name)
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{os.path.basename(path)}:{n.lineno} imports {a.name}")
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                    n.value.id in imported and n.attr.startswith("_") and \
                    not n.attr.startswith("__") and n.attr not in modules:
                found.append(f"{os.path.basename(path)}:{n.lineno} reads {n.value.id}.{n.attr}")
    return found


@pytest.mark.unit
def test_benchmarks_share_helpers_through_their_harness():
    """A benchmark imports what it shares from benchmarks/harness.py, never
    another benchmark's private names."""
    bench = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
    names = {os.path.basename(p)[:-3] for p in bench}
    found = []
    for path in bench:
        with open(path) as f:
            for n in ast.walk(ast.parse(f.read())):
                if isinstance(n, ast.ImportFrom) and n.module in names:
                    found += [f"{os.path.basename(path)}:{n.lineno} {n.module}.{a.name}"
                              for a in n.names if a.name.startswith("_")]
    assert "harness" in names and not found


def _module_names() -> set:
    return {name.rpartition(".")[2] for name in _modules()}


@pytest.mark.unit
def test_no_module_imports_private_names_of_another():
    """What a module keeps private (a leading underscore) stays in it."""
    assert not _private_imports(PY, _module_names())


@pytest.mark.unit
def test_the_private_import_check_sees_both_ways_in(tmp_path):
    (tmp_path / "m.py").write_text("from .a import _helper, public, _core\nfrom . import b\n"
                                   "b._hidden()\nb.shown()\n_core.x()\n")
    assert _private_imports([str(tmp_path / "m.py")], {"a", "b", "_core"}) == [
        "m.py:1 imports _helper", "m.py:3 reads b._hidden"]


@pytest.mark.unit
def _spelled(paths) -> list:
    """String constants (not docstrings) that spell a value name flor makes
    or a replay phase, outside flor/context.py, their one home."""
    found = []
    for path in paths:
        if os.path.relpath(path, ROOT) == os.path.join("flor", "context.py"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        docs = {id(n.value) for n in ast.walk(tree)
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs \
                    and (n.value.startswith(("state@", "stdout@", "tb:", "log:"))
                         or n.value in ("pre", "main", "post")):
                found.append(f"{os.path.basename(path)}:{n.lineno} {n.value!r}")
    return found


@pytest.mark.unit
def test_value_names_and_phases_are_spelled_only_in_the_vocabulary():
    assert not _spelled(PY)


@pytest.mark.unit
def test_the_spelling_check_finds_a_name_outside_the_vocabulary(tmp_path):
    (tmp_path / "m.py").write_text('"""stdout@ in a docstring is prose."""\n'
                                   'if phase == "pre":\n    name = "state@block"\n')
    assert _spelled([str(tmp_path / "m.py")]) == ["m.py:2 'pre'", "m.py:3 'state@block'"]


def test_every_module_is_named_in_the_architecture():
    """docs/ARCHITECTURE.md is the one description of the layout: each
    module has its line in its tree, under its package."""
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")) as f:
        text = f.read()
    tree = text.split("```", 2)[1]
    named, stack = set(), []
    for line in tree.splitlines():
        word = line.strip().split(" ")[0] if line.strip() else ""
        if not word:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        del stack[depth:]
        if word.endswith("/"):
            stack.append(word.rstrip("/"))
        elif word.endswith(".py"):
            named.add("/".join(stack + [word]))
    missing = [os.path.relpath(p, ROOT) for p in PY
               if os.path.relpath(p, ROOT) not in named and not p.endswith("__init__.py")]
    assert not missing, f"not in docs/ARCHITECTURE.md's tree: {missing}"


@pytest.mark.unit
def test_sql_runs_only_in_the_store():
    """Queries in store.py; opening the file, its schema and transactions in
    database.py."""
    sql = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE)\b [A-Za-z*]|\.execute(many)?\(")
    outside = []
    for path in PY:
        if os.path.relpath(path, ROOT) in ("flor/store.py", "flor/database.py"):
            continue
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if sql.search(line):
                    outside.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not outside


def _symbols(obj):
    out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, used = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            used.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRC" and parts[2].startswith("flor_"):
            defined.add(parts[2])
    return defined, used


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which(
    os.environ.get("CC", "cc")) is None, reason="needs a C compiler and nm")
def test_c_files_depend_on_each_other_without_a_circle(tmp_path):
    cc = os.environ.get("CC", "cc")
    include = sysconfig.get_paths()["include"]
    defined, used = {}, {}
    for src in C:
        obj = tmp_path / (os.path.basename(src) + ".o")
        subprocess.run([cc, "-c", "-std=c11", "-O0", "-pthread", f"-I{include}", src, "-o",
                        str(obj)], check=True, capture_output=True)
        name = os.path.basename(src)
        defined[name], used[name] = _symbols(str(obj))
    owner = {sym: name for name, syms in defined.items() for sym in syms}
    deps = {name: {owner[s] for s in used[name] if s in owner} - {name} for name in defined}
    _assert_no_circle(deps, "C files")
    # Nothing depends on the registration file.
    assert not [n for n, d in deps.items() if "module.c" in d]
    with open(os.path.join(ROOT, "csrc", "flor.h")) as f:
        header = f.read()
    assert [n for n in defined if n not in header] == [], "flor.h lists every C file"
