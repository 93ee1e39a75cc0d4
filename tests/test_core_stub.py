"""flor/_core.pyi describes the C module exactly: every name the module
holds is in the stub and every name in the stub is in the module, with the
same parameters for each function and method the module can describe."""
import ast
import inspect
import os

import pytest

from flor import _core

pytestmark = pytest.mark.unit  # in-process: `make check` runs these

STUB = os.path.join(os.path.dirname(_core.__file__), "_core.pyi")


def _stub():
    with open(STUB) as f:
        tree = ast.parse(f.read())
    names, classes = {}, {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = node
        elif isinstance(node, ast.ClassDef):
            names[node.name] = node
            members = {}
            for m in node.body:
                if isinstance(m, ast.FunctionDef):
                    members[m.name] = m
                elif isinstance(m, ast.AnnAssign):
                    members[m.target.id] = m
            classes[node.name] = members
    return names, classes


def _params(fn: ast.FunctionDef):
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]


def _public(names):
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def test_the_stub_lists_exactly_the_module_names():
    names, _ = _stub()
    assert set(names) == _public(dir(_core))


@pytest.mark.parametrize("name", sorted(n for n in _public(dir(_core))
                                        if callable(getattr(_core, n))
                                        and not isinstance(getattr(_core, n), type)))
def test_functions_take_the_stub_parameters(name):
    names, _ = _stub()
    sig = inspect.signature(getattr(_core, name))
    assert list(sig.parameters) == _params(names[name])


@pytest.mark.parametrize("name", sorted(n for n in _public(dir(_core))
                                        if isinstance(getattr(_core, n), type)))
def test_classes_have_the_stub_members(name):
    _, classes = _stub()
    cls = getattr(_core, name)
    members = classes[name]
    own = {m for m in vars(cls) if not m.startswith("__")} | (
        {"__reduce__"} if "__reduce__" in vars(cls) else set())
    if issubclass(cls, BaseException):
        own = set()  # an exception class's members come from Python
    assert own == set(members) - {"__init__"}
    for m, node in members.items():
        if isinstance(node, ast.FunctionDef) and m != "__init__" and m in vars(cls) \
                and not any(isinstance(d, ast.Name) and d.id == "property"
                            for d in node.decorator_list) and m != "__reduce__":
            assert list(inspect.signature(getattr(cls, m)).parameters)[1:] == _params(node), m
    init = members.get("__init__")
    if init is not None:
        assert list(inspect.signature(cls).parameters) == _params(init)

