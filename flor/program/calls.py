"""What a call runs, across the files of the project: the project's modules
that the analysis follows calls into (`Modules`), the imports of a file,
and how a call of the script resolves to a function or method of the
script or of a module it imports, or may run the project's callbacks,
forwards and overrides (`Calls`, the part of analysis.Script that answers
these).  Pure functions of source text, with `Modules`' `find` the one
place that looks at files (runtime/project.py gives it)."""
from __future__ import annotations

import ast
import builtins
import os

from . import hooks
from .syntax import assigned_names, path_of, root, walk_scope

__all__ = ["MISSING", "Modules", "Calls", "imports_of"]

MISSING = "missing"  # what Modules' find gives for a module found nowhere
_BUILTINS = set(dir(builtins))


class Modules:
    """The project's other modules, as the analysis follows calls into them
    (``from engine import train_one_epoch``): `find(dotted, level, path)`
    gives the (path, source) of the module that an import in the file at
    `path` names, None for one that is not the project's own, or MISSING
    for one found nowhere (a directory the script adds to sys.path as it
    runs, another import hook's: code the analysis cannot see, maybe the
    project's).  Each is parsed once; `owners` says which module's Script
    a function is of, `by_path` which files it knows (the script's own
    among them)."""

    def __init__(self, find):
        self.find = find
        self.scripts: dict = {}  # path -> Script (None while being made, or unparsable)
        self.owners: dict = {}  # id(function node) -> its module's Script
        self._found: dict = {}  # (dotted, level, directory) -> what find gave
        self.by_path: dict = {}  # path -> the first Script of that file
        self.closed = -1  # len(by_path) when every import of theirs was last parsed

    def script(self, dotted, level, path, make):
        """The Script (of class `make`) of the module an import in the file
        at `path` names, if it is the project's."""
        key = (dotted, level, os.path.dirname(path) if level and path else None)
        if key not in self._found:
            self._found[key] = self.find(dotted, level, path)
        found = self._found[key]
        if found is None or found == MISSING:
            return None
        path, source = found
        if path not in self.scripts:
            self.scripts[path] = None  # (an import cycle meets nothing meanwhile)
            try:
                tree = ast.parse(source)
            except SyntaxError:
                return None
            self.scripts[path] = make(tree, path, self)
        return self.scripts[path]

    def missing(self, dotted, level, path) -> bool:
        """Whether the module an import names was found nowhere."""
        key = (dotted, level, os.path.dirname(path) if level and path else None)
        if key not in self._found:
            self._found[key] = self.find(dotted, level, path)
        return self._found[key] == MISSING

    def register(self, script):
        if script.path is not None:
            self.by_path.setdefault(script.path, script)
        for n in ast.walk(script.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.owners[id(n)] = script


def _not_state(tree) -> set[str]:
    """Names bound at module level to modules, functions and classes."""
    out = set()
    for n in tree.body if isinstance(tree, ast.Module) else []:
        for sub in ast.walk(n) if isinstance(n, (ast.If, ast.Try, ast.With)) else [n]:
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                for a in sub.names:
                    out.add((a.asname or a.name).split(".")[0])
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(sub.name)
    return out


def imports_of(tree) -> dict:
    """{name: (module, attribute or None, level)} of the module-level
    imports of a file (``from m import f``: f; ``import a.b as c``: c);
    ``from m import *`` as [(m, level)] under "*"."""
    out = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom):
            for a in n.names:
                if a.name == "*":
                    out.setdefault("*", []).append((n.module or "", n.level))
                else:
                    out[a.asname or a.name] = (n.module or "", a.name, n.level)
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.asname:
                    out[a.asname] = (a.name, None, 0)
                else:
                    out[a.name.split(".")[0]] = (a.name.split(".")[0], None, 0)
    return out


class Calls:
    """How a file's calls resolve (the base of analysis.Script): its
    functions, classes and imports, and what a call of it runs."""

    def __init__(self, tree: ast.Module, path: str | None = None, modules: Modules | None = None):
        self.tree = tree
        self.path, self.modules = path, modules
        self.imports = imports_of(tree) if modules is not None else {}
        if modules is not None:
            modules.register(self)
        self.functions: dict[str, ast.FunctionDef | None] = {}
        for n in walk_scope(tree.body):
            if isinstance(n, ast.FunctionDef):
                # Defined twice: which definition runs is decided at run time.
                self.functions[n.name] = None if n.name in self.functions else n
        self.not_state = _not_state(tree) | {"__flor__"}  # (instrument.RUNTIME)
        self.classes = {n.name: n for n in walk_scope(tree.body) if isinstance(n, ast.ClassDef)}
        self.method_class = {id(m): c for c in self.classes.values() for m in c.body
                             if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self._types: dict = {}  # id(scope) -> {name: (Script, class name)}
        self._callable_list = None
        self._passed_methods = None
        self._inner_hooks = None
        self._call_sites = None
        self._project_classes = None

    @staticmethod
    def defs(scope) -> dict:
        """Functions defined in a function's body (a module's are the script's)."""
        if isinstance(scope, ast.Module):
            return {}
        return {n.name: n for n in scope.body if isinstance(n, ast.FunctionDef)}

    def types(self, scope) -> dict:
        """{name: (the Script, class name)} of the names `scope` binds to an
        instance of a class of the script or of a module of the project it
        imports: a method's first parameter, and ``x = Cls(...)``."""
        key = id(scope)
        if key not in self._types:
            out = {}
            cls = self.method_class.get(key)
            args = getattr(scope, "args", None)
            if cls is not None and args is not None and (args.posonlyargs + args.args):
                out[(args.posonlyargs + args.args)[0].arg] = (self, cls.name)
            for n in walk_scope(scope.body):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and \
                        isinstance(n.value.func, (ast.Name, ast.Attribute)):
                    func = n.value.func
                    if isinstance(func, ast.Name):
                        of = self.class_of(func.id)
                    else:  # mylib.Trainer(...)
                        found = self.dotted(func)
                        of = found[0].class_of(found[1]) if found is not None else None
                    for t in n.targets:
                        if of is not None and isinstance(t, ast.Name):
                            out[t.id] = of
            self._types[key] = out
        return self._types[key]

    def class_of(self, name, depth=0):
        """(Script, class name) of the class `name` names here, if it is the
        script's or an imported module's of the project."""
        if name in self.classes:
            return self, name
        found = self.imported(name)
        if found is None or found[1] is None or depth > 4:
            return None
        return found[0].class_of(found[1], depth + 1)

    def imported(self, name):
        """(the module's Script, the attribute imported or None) of a name
        the script imports from a module of the project (``from pkg import
        engine``: engine's, None)."""
        spec = self.imports.get(name)
        if spec is None or name == "*" or self.modules is None or name in self.functions or \
                name in self.classes:
            return None
        module, attr, level = spec
        if attr is not None:
            sub = self.modules.script(f"{module}.{attr}" if module else attr, level, self.path,
                                      type(self))
            if sub is not None:
                return sub, None
        other = self.modules.script(module, level, self.path, type(self))
        return None if other is None else (other, attr)

    def function(self, name, depth=0):
        """The module-level function `name` of the script, or the one an
        import of it names in a module of the project."""
        if name in self.functions:
            return self.functions[name]
        found = self.imported(name)
        if found is None and self.modules is not None and depth <= 4:
            for module, level in self.imports.get("*", []):  # from m import *
                other = self.modules.script(module, level, self.path, type(self))
                fn = other.function(name, depth + 1) if other is not None else None
                if fn is not None:
                    return fn
        if found is None or found[1] is None or depth > 4:
            return None
        return found[0].function(found[1], depth + 1)

    def dotted(self, node):
        """(the module's Script, the name) of ``pkg.sub.name`` where pkg is
        an import of a module of the project (``import mylib.ema``)."""
        p = path_of(node)
        if p is None or "[" in p or "." not in p or self.modules is None:
            return None
        parts = p.split(".")
        spec = self.imports.get(parts[0])
        if spec is None or parts[0] == "*" or spec[1] is not None:
            return None
        module = ".".join([spec[0]] + parts[1:-1])  # (import a.b as c: c.x.f is a.b.x's f)
        other = self.modules.script(module, spec[2], self.path, type(self))
        return None if other is None else (other, parts[-1])

    def unseen(self, call) -> str | None:
        """The module a call goes into that the analysis found nowhere (its
        name), where the call's name comes from an import of one."""
        if self.modules is None:
            return None
        p = path_of(call.func)
        if p is None:
            return None
        spec = self.imports.get(root(p))
        if spec is None or root(p) == "*":
            stars = [m for m, level in self.imports.get("*", [])
                     if self.modules.missing(m, level, self.path)]
            return stars[0] if stars and isinstance(call.func, ast.Name) and \
                call.func.id not in self.functions and call.func.id not in _BUILTINS else None
        module, _, level = spec  # (the module imported: a name in it may be a class)
        return module or "." if self.modules.missing(module, level, self.path) else None

    def _scripts(self) -> list:
        """This script, and the other files of the project: those it knows,
        and every module of the project they import, transitively."""
        if self.modules is None:
            return [self]
        if self.modules.closed != len(self.modules.by_path):
            self._close()
        return [self] + [s for s in self.modules.by_path.values()
                         if s is not self and s.path != self.path]

    def _close(self):
        """Parse every module of the project that a known file imports."""
        seen, todo = set(), list(self.modules.by_path.values()) + [self]
        while todo:
            s = todo.pop()
            if id(s) in seen:
                continue
            seen.add(id(s))
            for name, spec in s.imports.items():
                specs = spec if name == "*" else [(spec[0], spec[2])] + (
                    [(f"{spec[0]}.{spec[1]}" if spec[0] else spec[1], spec[2])]
                    if spec[1] is not None else [])
                for module, level in specs:
                    other = self.modules.script(module, level, s.path, type(self))
                    if other is not None:
                        todo.append(other)
        self.modules.closed = len(self.modules.by_path)

    def has_method(self, name) -> bool:
        """Whether a class of the project has a method `name`."""
        return bool(self._methods(name))

    def _methods(self, name) -> list:
        return [m for s in self._scripts() for c in s.classes.values() for m in c.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == name]

    def may_run(self, call, scope) -> list:
        """The functions of the project that a call the analysis cannot
        resolve may run: for ``obj.name(...)`` on an object of no known
        class, every method `name` of the project's classes; for a call of
        a callable held in a variable or an attribute (``cb(self)``,
        ``self.model(x)``, ``net(x)``) or an item (``models["G"](z)``,
        ``self.heads[k](h)``), every function of the project that some code
        hands over as a value (a callback) and every ``forward`` and
        ``__call__`` of its classes.  Not a module's function
        (``torch.save``), a class, or a builtin."""
        func = call.func
        if isinstance(func, ast.Subscript):
            held = path_of(func.value)
            if held is None or root(held) in self.imports or \
                    (root(held) in self.not_state and root(held) not in self.classes):
                return []
            return self._callables()
        if isinstance(func, ast.Name):
            name = func.id
            if name in self.defs(scope) or name in self.functions or name in self.classes \
                    or name in self.imports or name in self.not_state or \
                    (name in _BUILTINS and name not in assigned_names(scope.body)):
                return []
            return self._callables()
        if not isinstance(func, ast.Attribute) or path_of(func.value) is None:
            return []
        r = root(path_of(func.value))
        if r in self.imports or (r in self.not_state and r not in self.classes):
            return []  # torch.save(...), a module's function
        methods = self._methods(func.attr)
        return methods if methods else self._callables()

    def _callables(self) -> list:
        if self._callable_list is None:
            out = []
            for s in self._scripts():
                passed = _passed_names(s.tree)
                out += [f for name, f in s.functions.items() if f is not None and (
                    name in passed or _registered(f, s.functions))]
                out += [m for c in s.classes.values() for m in c.body
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and m.name in ("forward", "__call__")]
            out += [m for m, _ in self.passed_methods().values()]
            out += [f for f, _ in self.inner_hooks().values()]
            self._callable_list = list({id(f): f for f in out}.values())
        return self._callable_list

    def project_classes(self) -> dict:
        """{name: class} of the classes of the project's files, once."""
        if self._project_classes is None:
            self._project_classes = {c.name: c for s in self._scripts()
                                     for c in s.classes.values()}
        return self._project_classes

    def derives(self, cls, base: str, seen=()) -> bool:
        """Whether the project's class `cls` (a ClassDef, or its name)
        derives from the class named `base` (through the project's classes)."""
        c = self.project_classes().get(cls) if isinstance(cls, str) else cls
        if c is None or c.name in seen:
            return False
        for b in c.bases:
            b_name = b.id if isinstance(b, ast.Name) else b.attr \
                if isinstance(b, ast.Attribute) else None
            if b_name == base or (b_name is not None
                                  and self.derives(b_name, base, seen + (c.name,))):
                return True
        return False

    def passed_methods(self) -> dict:
        """{id(method): (method, [Site])}: hooks.handed_over, once."""
        if self._passed_methods is None:
            self._passed_methods = hooks.handed_over(self._scripts())
        return self._passed_methods

    def inner_hooks(self) -> dict:
        """{id(fn): (fn, enclosing)}: hooks.inner_functions, once."""
        if self._inner_hooks is None:
            self._inner_hooks = hooks.inner_functions(self._scripts(), self.modules)
        return self._inner_hooks

    def call_sites(self, fn) -> list:
        """(Script, scope, call) for each call in the project that runs
        function `fn` by its name (``recorder(self.acts, "head")``)."""
        if self._call_sites is None:
            self._call_sites = hooks.calls_by_callee(self._scripts())
        return self._call_sites.get(id(fn), [])

    def overrides(self, fn) -> list:
        """The methods that override method `fn` in the project's classes
        derived from its class (``self.on_after_step()`` in a base trainer
        runs a subclass's)."""
        owner = self.owner(fn)
        cls = owner.method_class.get(id(fn))
        if cls is None:
            return []
        return [m for c in self.project_classes().values()
                if c is not cls and self.derives(c, cls.name) for m in c.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == fn.name]

    def owner(self, fn) -> "Script":
        """The Script whose function `fn` is."""
        return self.modules.owners.get(id(fn), self) if self.modules is not None else self

    def method(self, cls_name: str, name: str, seen=()):
        """The method `name` of the script's class (or of its bases in the script)."""
        cls = self.classes.get(cls_name)
        if cls is None or cls_name in seen:
            return None
        for m in cls.body:
            if isinstance(m, ast.FunctionDef) and m.name == name:
                return m
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.method(base.id, name, seen + (cls_name,))
                if found is not None:
                    return found
        return None

    def resolve(self, call: ast.Call, scope) -> ast.FunctionDef | None:
        """The function of the script that `call`, in `scope`, runs: a
        function by name, or a method of an object whose class is the
        script's (``self.train_epoch()``, ``trainer.fit()``)."""
        if isinstance(call.func, ast.Name):
            name = call.func.id
            defs = self.defs(scope)
            return defs[name] if name in defs else self.function(name)
        if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
            of = self.types(scope).get(call.func.value.id) or \
                self.class_of(call.func.value.id)  # Counter.bump()
            if of is not None:
                return of[0].method(of[1], call.func.attr)
            found = self.imported(call.func.value.id)  # import engine; engine.train(...)
            if found is not None and found[1] is None:
                return found[0].function(call.func.attr)
        if isinstance(call.func, ast.Attribute):  # import mylib.ema; mylib.ema.update(...)
            found = self.dotted(call.func)
            if found is not None:
                return found[0].function(found[1])
        return None

    def is_script_function(self, call, scope) -> bool:
        if isinstance(call.func, ast.Name):
            return call.func.id in self.defs(scope) or call.func.id in self.functions or \
                self.resolve(call, scope) is not None
        return self.resolve(call, scope) is not None



def _registered(fn, functions) -> bool:
    """Whether a decorator of the project's own hands `fn` over (``@on_step``
    that appends it to a list of callbacks)."""
    for d in fn.decorator_list:
        p = path_of(d.func if isinstance(d, ast.Call) else d)
        if p is not None and root(p) in functions:
            return True
    return False


def _passed_names(tree) -> set[str]:
    """Names a file refers to other than by calling them (a function handed
    over as a value: ``callbacks=[report]``)."""
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load) and id(n) not in called}
