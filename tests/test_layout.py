"""The source layout keeps the shape docs/ARCHITECTURE.md describes: every
module named there, Python modules and C files that depend on each other
without a circle (imports inside functions count), every SQL statement in
flor/store.py.  Modules over 500 lines and classes over 250 are reported
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


def test_python_modules_import_each_other_without_a_circle():
    _assert_no_circle(_imports(_modules()), "modules")


def test_the_circle_check_sees_imports_inside_functions(tmp_path):
    """The check above can fail: a circle closed by an import in a function."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    (tmp_path / "__init__.py").write_text("")
    a.write_text("from . import b\n")
    b.write_text("def f():\n    from .a import x\n")
    graph = _imports({"p": str(tmp_path / "__init__.py"), "p.a": str(a), "p.b": str(b)})
    assert graph["p.a"] == ["p.b"] and graph["p.b"] == ["p.a"]


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


def test_sql_runs_only_in_the_store():
    sql = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE)\b [A-Za-z*]|\.execute(many)?\(")
    outside = []
    for path in PY:
        if os.path.basename(path) == "store.py":
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
