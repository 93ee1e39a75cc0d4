"""The source distribution: built by setuptools' PEP 517 backend from a copy
of this tree, it is named flor-hindsight (PyPI's `flor` is another project),
carries the license metadata, the classifiers and the flor console script,
holds every tracked file the test suite reads, and, unpacked, builds the C
core and passes part of its own suite.

Builds run in subprocesses: setuptools logs and may warn, and this suite
turns warnings into errors in-process."""
import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib

import pytest

from conftest import ROOT

DIST = "flor-hindsight"

# Left out of the copy the sdist is built from: version control, environments,
# earlier builds (an old SOURCES.txt would feed setuptools' file list), stores.
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", ".venv-*", "*.egg-info", "build", "dist",
                                    ".flor", ".pytest_cache", "__pycache__", "*.so", "*.o",
                                    "bench-results")

# Build artefacts put where MANIFEST.in grafts whole folders: none may ship.
PLANTED = ["tests/scripts/__pycache__/planted.cpython-311.pyc", "tests/scripts/planted.pyc",
           "tests/scripts/.flor/planted.db", "tests/scripts/handsfree/.flor/planted.db",
           "tests/scripts/planted.so", "tests/scripts/planted.o",
           "docs/__pycache__/planted.cpython-311.pyc"]

REQUIRED = ["LICENSE", "README.md", "Makefile", "pyproject.toml", "setup.py", "MANIFEST.in",
            "csrc/flor.h", "csrc/module.c", "flor/_core.pyi", "flor/py.typed",
            "flor/__main__.py", "examples/train_digits.py",
            "tests/conftest.py", "tests/crafted.py", "tests/make_golden.py",
            "tests/test_format.py", "tests/test_packaging.py", "tests/data/golden-v1.flor", "tests/data/golden-v2.flor",
            "tests/scripts/counting.py", "tests/scripts/handsfree/idioms/closure.py",
            "tests/scripts/ddp/ddp_digits.py", "benchmarks/workloads/image_cnn.py"]

CLASSIFIERS = {
    "Development Status :: 3 - Alpha",
    "Intended Audience :: Science/Research",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: C",
    "Operating System :: POSIX :: Linux",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
}

# Tracked files the sdist leaves out on purpose: CI, git's own, measured results.
NOT_SHIPPED = (".ci/", ".gitignore", "benchmarks/results/")


def _env(**extra):
    """This environment without pytest's variables or a PYTHONPATH of its own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def _run(argv, cwd, timeout=300, **env):
    proc = subprocess.run(argv, cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"{argv[:4]} exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def _backend(cwd, call, out):
    """Call setuptools.build_meta's `call` with `out` in `cwd`, warnings as
    errors; return the name it returns."""
    code = f"import sys; from setuptools import build_meta as b; print(b.{call}(sys.argv[1]))"
    proc = _run([sys.executable, "-W", "error", "-c", code, str(out)], cwd, timeout=120)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    base = tmp_path_factory.mktemp("sdist")
    src, out = base / "src", base / "out"
    shutil.copytree(ROOT, src, ignore=NOT_COPIED)
    for rel in PLANTED:
        os.makedirs(os.path.dirname(src / rel), exist_ok=True)
        (src / rel).write_bytes(b"not for the sdist\n")
    out.mkdir()
    return out / _backend(src, "build_sdist", out)


@pytest.fixture(scope="module")
def members(sdist):
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    top = os.path.basename(str(sdist))[: -len(".tar.gz")]
    assert all(n == top or n.startswith(top + "/") for n in names), names[:5]
    return {n[len(top) + 1:] for n in names if n != top}


@pytest.fixture(scope="module")
def unpacked(sdist, tmp_path_factory):
    """The sdist unpacked, its C core built in place."""
    dest = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.11.4 on
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    (root,) = dest.iterdir()
    _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], root)
    return root


def test_the_sdist_holds_the_test_suite_and_no_build_artefacts(sdist, members):
    assert os.path.basename(str(sdist)) == "flor_hindsight-0.2.0.tar.gz"
    assert [f for f in REQUIRED if f not in members] == []
    artefacts = [m for m in members
                 if m.endswith((".so", ".o", ".pyc")) or "__pycache__" in m.split("/")
                 or ".flor" in m.split("/")]
    assert artefacts == []


def test_pkg_info_names_the_distribution_its_license_and_classifiers(unpacked):
    with open(unpacked / "PKG-INFO") as f:
        info = email.parser.HeaderParser().parse(f)
    assert info["Name"] == DIST
    assert info["License-Expression"] == "Apache-2.0"
    assert info.get_all("License-File") == ["LICENSE"]
    assert CLASSIFIERS <= set(info.get_all("Classifier"))
    assert info["Author"] == "The Flor authors"
    extras = set(info.get_all("Provides-Extra"))
    assert {"test", "plot", "tensorboard", "progress", "ray"} <= extras
    requires = info.get_all("Requires-Dist")
    for dep in ("matplotlib", "tensorboard", "tqdm"):
        assert f'{dep}; extra == "test"' in requires
    assert [r for r in requires if "torch" in r.split(";")[0]] == []
    with open(unpacked / "pyproject.toml", "rb") as f:
        build = tomllib.load(f)["build-system"]["requires"]
    assert not [r for r in build if "torch" in r]
    with open(unpacked / "LICENSE") as f:
        text = f.read()
    assert text.startswith("Copyright 2026 The Flor authors\n")
    assert "Apache License\n" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_sdist_holds_every_tracked_file_but_ci_and_results(members):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    top = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(ROOT):
        pytest.skip("not a git checkout (an unpacked sdist, say)")
    tracked = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    tracked = [f for f in tracked if os.path.exists(os.path.join(ROOT, f))]
    assert "tests/conftest.py" in tracked
    missing = [f for f in tracked if f not in members]
    assert [f for f in missing if not f.startswith(NOT_SHIPPED)] == []


def test_the_unpacked_sdist_passes_its_own_tests(unpacked):
    where = _run([sys.executable, "-c", "import flor._core; print(flor._core.__file__)"],
                 unpacked, PYTHONPATH=str(unpacked)).stdout.strip()
    assert os.path.dirname(os.path.dirname(where)) == str(unpacked)
    # The write-error and crash tests of test_format fork writers and take
    # seconds each; the rest load the golden files and check the stub.
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                 "tests/test_core_stub.py", "tests/test_layout.py", "tests/test_format.py",
                 "-k", "not flush and not kill"], unpacked, PYTHONPATH=str(unpacked))
    for test in ("test_format.py::test_golden_file_loads",
                 "test_format.py::test_golden_version_2_files_load",
                 "test_layout.py::test_c_files_depend_on_each_other_without_a_circle"):
        assert f"PASSED tests/{test}" in proc.stdout
    assert " failed" not in proc.stdout and " skipped" not in proc.stdout


def test_the_wheel_metadata_has_the_flor_console_script(unpacked, tmp_path):
    from importlib.metadata import PathDistribution

    info = tmp_path / _backend(unpacked, "prepare_metadata_for_build_wheel", tmp_path)
    dist = PathDistribution(info)
    assert dist.metadata["Name"] == DIST
    scripts = [(e.name, e.value) for e in dist.entry_points if e.group == "console_scripts"]
    assert scripts == [("flor", "flor.__main__:main")]
    # What the installed `flor` script does: sys.exit(main()), argv from sys.argv.
    launch = ("import sys; from importlib.metadata import EntryPoint; sys.argv[0] = 'flor'; "
              f"sys.exit(EntryPoint('flor', {scripts[0][1]!r}, 'console_scripts').load()())")
    ok = _run([sys.executable, "-c", launch, "--help"], unpacked, PYTHONPATH=str(unpacked))
    assert "flor record" in ok.stdout
    bad = subprocess.run([sys.executable, "-c", launch, "no-such-command"], cwd=unpacked,
                         env=_env(PYTHONPATH=str(unpacked)), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr
