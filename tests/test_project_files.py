"""Which files are the project's own modules (runtime/project.py), how a
run keeps the source of one above the script's directory, and which
changed functions other code is handed as values (program/source.py)."""
import os
import textwrap

import pytest

from flor.layout import Layout
from flor.program.source import passed_as_values
from flor.runtime.project import ROOT_ENV, own_file, project_root

pytestmark = pytest.mark.unit


def _touch(path, text=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_the_root_is_the_nearest_directory_with_a_project_marker(tmp_path, monkeypatch):
    monkeypatch.delenv(ROOT_ENV, raising=False)
    d = str(tmp_path)
    script = os.path.join(d, "repo", "examples", "mnist", "train.py")
    _touch(script)
    # No marker up to the file system's root: the script's directory.
    if not any(os.path.exists(os.path.join(p, m)) for p in [d, os.path.dirname(d), "/"]
               for m in (".git", "pyproject.toml", "setup.py", "setup.cfg")):
        assert project_root(script) == os.path.dirname(script)
    _touch(os.path.join(d, "repo", "pyproject.toml"))
    assert project_root(script) == os.path.join(d, "repo")
    monkeypatch.setenv(ROOT_ENV, os.path.join(d, "repo", "examples"))
    assert project_root(script) == os.path.join(d, "repo", "examples")
    monkeypatch.setenv(ROOT_ENV, "none")
    assert project_root(script) is None


def test_own_files_leave_out_environments_libraries_and_flor(tmp_path):
    root = str(tmp_path)
    _touch(os.path.join(root, "mylib", "trainer.py"))
    _touch(os.path.join(root, ".venv", "pyvenv.cfg"))
    _touch(os.path.join(root, ".venv", "lib", "python3.11", "site-packages", "pkg", "m.py"))
    _touch(os.path.join(root, "env2", "pyvenv.cfg"))
    _touch(os.path.join(root, "env2", "tools", "m.py"))
    assert own_file(os.path.join(root, "mylib", "trainer.py"), root)
    assert not own_file(os.path.join(root, "mylib", "data.json"), root)
    assert not own_file(os.path.join(root, ".venv", "lib", "python3.11", "site-packages",
                                     "pkg", "m.py"), root)
    assert not own_file(os.path.join(root, "env2", "tools", "m.py"), root)
    assert not own_file(os.path.join(str(tmp_path.parent), "other.py"), root)
    assert not own_file(os.__file__, os.path.dirname(os.__file__))
    import flor

    flor_dir = os.path.dirname(os.path.dirname(flor.__file__))
    assert not own_file(os.path.join(os.path.dirname(flor.__file__), "api.py"), flor_dir)
    assert not own_file(os.path.join(root, "mylib", "trainer.py"), None)


def test_a_module_above_the_scripts_directory_is_kept_inside_the_run(tmp_path):
    layout = Layout(str(tmp_path / ".flor"))
    os.makedirs(layout.run_dir("r1"))
    layout.save_module_source("r1", os.path.join("..", "..", "mylib", "trainer.py"), "x = 1\n")
    layout.save_module_source("r1", os.path.join("utils.py"), "y = 2\n")
    saved = [os.path.join(dp, f) for dp, _, fs in os.walk(layout.run_dir("r1")) for f in fs]
    assert all(p.startswith(layout.run_dir("r1") + os.sep) for p in saved), saved
    sources = layout.module_sources("r1")
    assert sources[os.path.join("..", "..", "mylib", "trainer.py")] == "x = 1\n"
    assert sources["utils.py"] == "y = 2\n"


def test_changed_functions_handed_over_as_values():
    script = textwrap.dedent("""
        def report(trainer):
            print(trainer.loss)

        def helper():
            return 1

        def main():
            t = Trainer(callbacks=[report])
            t.set_callback("on_batch_end", on_batch)
            helper()
            t.fit()
        """)
    names = {"report", "helper", "main", "on_batch", "fit"}
    assert passed_as_values({"train.py": script}, names) == {"report", "on_batch"}
