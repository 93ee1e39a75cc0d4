"""The source layout keeps the shape docs/ARCHITECTURE.md describes: no
Python module over 500 lines and no class over 250, every SQL statement in
flor/store.py, and C files that depend on each other without a circle."""
import ast
import glob
import os
import re
import shutil
import subprocess
import sysconfig

import pytest

from conftest import ROOT

PY = sorted(glob.glob(os.path.join(ROOT, "flor", "**", "*.py"), recursive=True))
C = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c")))


def test_python_modules_and_classes_stay_small():
    too_long = []
    for path in PY:
        with open(path) as f:
            text = f.read()
        rel = os.path.relpath(path, ROOT)
        if text.count("\n") > 500:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                too_long.append(f"{rel}: class {node.name}, "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_long


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
    # Depth-first search for a circle.
    state = {}

    def visit(n, path):
        state[n] = "open"
        for m in sorted(deps[n]):
            assert state.get(m) != "open", "C files in a circle: " + " -> ".join(path + [n, m])
            if m not in state:
                visit(m, path + [n])
        state[n] = "done"
    for n in sorted(deps):
        if n not in state:
            visit(n, [])
    # Nothing depends on the registration file.
    assert not [n for n, d in deps.items() if "module.c" in d]
    with open(os.path.join(ROOT, "csrc", "flor.h")) as f:
        header = f.read()
    assert [n for n in defined if n not in header] == [], "flor.h lists every C file"
