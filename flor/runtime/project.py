"""The project's own modules in hands-free mode: which source files are the
user's, and the import hook that instruments them as the script is.

The project's root is the nearest directory, from the script's own upwards,
that holds ``.git``, ``pyproject.toml``, ``setup.py`` or ``setup.cfg``; the
script's directory where none does.  FLOR_PROJECT_ROOT=DIR sets it (wider or
narrower); FLOR_PROJECT_ROOT=none instruments the script alone.  A module
the script imports is the project's when its source file lies under the
root and not in the standard library, a site-packages or dist-packages
directory, a virtual environment (a directory with ``pyvenv.cfg``), or flor
itself.  An editable install of the project is the project's.

While a hands-free record or replay runs, `Instrumenting` (a meta path
finder) hands each such module's import a loader that compiles the module
instrumented (program/instrument.py): its loops are candidate main loops
and their nested loops blocks, keyed by the file's path relative to the
script's directory (``mylib/trainer.py:42``).  The loader never reads or
writes bytecode caches: a cached file holds the module as written.
"""
from __future__ import annotations

import ast
import functools
import importlib.machinery
import os
import sys
import sysconfig

from ..context import location
from ..program.analysis import MISSING, Modules, Script
from ..program.instrument import RUNTIME, instrument

__all__ = ["ROOT_ENV", "project_root", "own_file", "modules_of", "Instrumenting",
           "recording_keys", "replay_keys"]

ROOT_ENV = "FLOR_PROJECT_ROOT"
_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
_FLOR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_root(script: str) -> str | None:
    """The root of `script`'s project (None: the script alone)."""
    env = os.environ.get(ROOT_ENV, "").strip()
    if env.lower() == "none":
        return None
    if env:
        return os.path.abspath(env)
    home = os.path.dirname(os.path.abspath(script))
    cur = home
    while True:
        if any(os.path.exists(os.path.join(cur, m)) for m in _MARKERS):
            return cur
        parent = os.path.dirname(cur)
        if parent == cur:
            return home
        cur = parent


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.abspath(d) for d in dirs if d)) + (_FLOR,)


def own_file(path: str, root: str | None) -> bool:
    """Whether the source file `path` is one of the project's own modules."""
    if root is None or not path.endswith(".py"):
        return False
    path = os.path.abspath(path)
    if not path.startswith(root.rstrip(os.sep) + os.sep):
        return False
    if any(path.startswith(d + os.sep) for d in _library_dirs()):
        return False
    parts = os.path.relpath(path, root).split(os.sep)
    if any(p in ("site-packages", "dist-packages") for p in parts):
        return False
    d = os.path.dirname(path)
    while d.startswith(root):
        if os.path.exists(os.path.join(d, "pyvenv.cfg")):
            return False
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return True


class _Loader(importlib.machinery.SourceFileLoader):
    """A module of the project, compiled instrumented."""

    def __init__(self, fullname, path, hook):
        super().__init__(fullname, path)
        self.hook = hook

    def get_code(self, fullname):
        source = self.get_source(fullname)
        inst = self.hook.instrument(source, self.path)
        return inst.code

    def exec_module(self, module):
        from . import handsfree

        module.__dict__[RUNTIME] = handsfree
        super().exec_module(module)


class Instrumenting:
    """The import hook: `keys(path)` gives the location function of a
    module's lines (context.location), or None for a module left as it is;
    `seen(path, rel, source, inst)` is told of each module instrumented."""

    def __init__(self, base, keys, seen=None, modules=None):
        self.base, self.keys, self.seen, self.analysis = base, keys, seen, modules
        self._finding: set = set()  # names being looked up by the other finders

    def __enter__(self):
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc):
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name, path=None, target=None):
        # The other finders find it (another hook that asks the finders
        # again, effects.py's, gets None from this one meanwhile).
        if name in self._finding:
            return None
        self._finding.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.discard(name)
        if not isinstance(spec.loader, importlib.machinery.SourceFileLoader) or \
                not spec.origin or self.keys(os.path.abspath(spec.origin)) is None:
            return None
        spec.loader = _Loader(name, spec.origin, self)
        spec.cached = None
        return spec

    def instrument(self, source, path):
        path = os.path.abspath(path)
        rel = os.path.relpath(path, self.base)
        inst = instrument(source, path, self.keys(path), self.analysis, imported=True)
        if self.seen is not None:
            self.seen(path, rel, source, inst)
        return inst


def modules_of(script: str) -> Modules:
    """The project's modules of `script` as its analysis follows calls into
    them: found where ``python script.py`` finds them (the script's
    directory, then sys.path, then the other import hooks, such as an
    editable install's), without importing anything, and only the project's
    own (`own_file`); MISSING for a module found nowhere (a directory the
    script adds to sys.path as it runs)."""
    script = os.path.abspath(script)
    base, root = os.path.dirname(script), project_root(script)
    search = [base] + [os.path.abspath(p) for p in sys.path[1:] if p]
    suffixes = importlib.machinery.all_suffixes()

    def source(candidate):
        if not candidate.endswith(".py") or not own_file(candidate, root):
            return None  # a library's (an extension module's too)
        try:
            with open(candidate, encoding="utf-8") as f:
                return candidate, f.read()
        except (OSError, UnicodeDecodeError):
            return None

    def find(dotted, level, path):
        parts = [p for p in dotted.split(".") if p]
        if level:
            if path is None:
                return None
            d = os.path.dirname(os.path.abspath(path))
            for _ in range(level - 1):
                d = os.path.dirname(d)
            places = [os.path.join(d, *parts)]
        else:
            if not parts or parts[0] in sys.builtin_module_names or \
                    parts[0] in sys.stdlib_module_names:
                return None
            places = [os.path.join(p, *parts) for p in search]
            places += [os.path.join(d, *parts[1:]) for d in _hooked(parts[0])]
        for place in places:
            for candidate in [place + s for s in suffixes] + [os.path.join(place, "__init__.py")]:
                if os.path.isfile(candidate):
                    return source(candidate)
            if os.path.isdir(place):
                return None  # a namespace package: its modules are found by their names
        return MISSING
    modules = Modules(find)
    try:  # the script's own classes, whose methods a module's code may call back
        with open(script, encoding="utf-8") as f:
            Script(ast.parse(f.read()), script, modules)
    except (OSError, UnicodeDecodeError, SyntaxError):
        pass
    return modules


_STANDARD = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter,
             importlib.machinery.PathFinder)


def _hooked(top) -> list[str]:
    """Where the import hooks other than the path's (an editable install's
    finder) would find the top-level module `top`: its package directory,
    or the directory holding it.  Only top-level names: no package is
    imported."""
    out = []
    for finder in sys.meta_path:
        if finder in _STANDARD or isinstance(finder, Instrumenting) or \
                not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(top, None)
        except Exception:  # another hook's error is not the analysis's
            continue
        if spec is not None and spec.submodule_search_locations:
            out += list(spec.submodule_search_locations)
        elif spec is not None and spec.origin and os.path.isfile(spec.origin):
            out.append(os.path.splitext(spec.origin)[0])
    return out


def recording_keys(script: str):
    """A record's `keys` for Instrumenting: the project's own modules (not
    the script, which is instrumented already), keyed by their lines."""
    script = os.path.abspath(script)
    base, root = os.path.dirname(script), project_root(script)

    def keys(path):
        if path == script or not own_file(path, root):
            return None
        rel = os.path.relpath(path, base)
        return lambda line: location(rel, line)
    return keys


def replay_keys(script: str, modules, files):
    """A replay's `keys`: the modules the record instrumented (`modules`,
    their paths relative to the script's directory), each line keyed by its
    line in the recorded file (`files`: plan.files, source.FileMap by path)."""
    base, modules = os.path.dirname(os.path.abspath(script)), set(modules)

    def keys(path):
        rel = os.path.relpath(path, base)
        if rel not in modules:
            return None
        lines = files[rel].lines if rel in files else {}
        return lambda line: location(rel, line, lines.get(line), mapped=True)
    return keys
