# Entry points (README.md): `make demo` and `make test`. Both set up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ASAN_VENV ?= .venv-asan
# The CPU wheel on this machine. An unpinned torch would pull gigabytes of CUDA
# packages, so torch is installed first, pinned, and never by pip's resolver.
TORCH := torch==2.13.0
PIP := pip install -q --disable-pip-version-check

.PHONY: setup demo check test test-fast test-asan docs format format-check bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/$(PIP) $(TORCH) 'setuptools>=77' wheel
	$(BIN)/$(PIP) --no-build-isolation -e '.[test,examples]'

demo: setup
	$(BIN)/python examples/demo.py

# Two test processes (pytest-xdist): most of the suite's time is end-to-end
# tests whose subprocesses run one torch thread each.
PYTEST_JOBS := -n auto --maxprocesses=2
# The slowest tests, listed after each full run: where CI's time goes.
DURATIONS := --durations=60

# Ray (the optional extra for replay --backend ray) is installed for its test,
# which starts a local Ray cluster; Lightning, Accelerate and transformers for
# their tests (test_lightning.py, test_accelerate.py, test_huggingface.py), with
# torch pinned in the same command; OmegaConf and jsonargparse for
# test_config.py (the config objects of Hydra and of LightningCLI); MLflow for
# test_results.py (flor export --mlflow, read back with MLflow's client).
test: setup
	$(BIN)/$(PIP) 'ray>=2.9' 'omegaconf==2.3.0' 'jsonargparse==4.53.0'
	$(BIN)/$(PIP) $(TORCH) 'mlflow==3.17.2'
	$(BIN)/$(PIP) $(TORCH) 'lightning==2.6.6' 'accelerate==1.15.0' 'transformers==5.24.0'
	$(BIN)/python -m pytest -q $(PYTEST_JOBS) $(DURATIONS)

# The edit-test loop's first step: the unit tier, the tests that run in the
# test process (marker `unit`: no script recorded or replayed), in seconds.
check: setup
	$(BIN)/python -m pytest -q -m unit

# The edit-test loop: the suite without the differential replays of every
# segment boundary (tests/test_exactness.py), which CI's `make test` runs.
test-fast: setup
	$(BIN)/python -m pytest -q $(PYTEST_JOBS) -m "not differential"

# The C core's tests against an AddressSanitizer + UndefinedBehaviorSanitizer
# build, installed (not editable) in its own environment and built in
# build/sanitize: the unit tier (most of it calls the C core directly) and
# the end-to-end tests marked `core` (snapshots, checkpoint files, fingerprints,
# digests, the materializer's modes, records killed while they write, crafted
# files, state the walk cannot copy). The others (the differential replays,
# the program analysis, the command line, files and side effects, ranks under
# torchrun, resumes and lifecycles) exercise Python over the same C paths;
# `make test` runs them.
# Leak reports are off (CPython and torch hold memory until exit); the
# quarantine stays on so that use-after-free is caught. FLOR_SANITIZED tells
# the RSS leak checks that RSS is not meaningful under that quarantine.
ASAN_ENV = LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" \
	ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc FLOR_SANITIZED=1

test-asan:
	test -x $(ASAN_VENV)/bin/python || $(PYTHON) -m venv $(ASAN_VENV)
	$(ASAN_VENV)/bin/$(PIP) $(TORCH) 'setuptools>=77' wheel
	# the test extra of pyproject.toml (flor itself is installed below, sanitized)
	$(ASAN_VENV)/bin/$(PIP) pytest pytest-xdist cloudpickle numpy pandas scikit-learn \
		matplotlib tensorboard tqdm
	FLOR_SANITIZE=1 $(ASAN_VENV)/bin/$(PIP) --no-build-isolation --force-reinstall --no-deps .
	cd tests && $(ASAN_ENV) ../$(ASAN_VENV)/bin/python -c \
		"import flor._core as c, sys; sys.exit(0 if '$(ASAN_VENV)' in c.__file__ else 'not the sanitizer build: ' + c.__file__)"
	cd tests && $(ASAN_ENV) ../$(ASAN_VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_JOBS) \
		$(DURATIONS) -m "unit or core" .

# The manual as a site (mkdocs.yml): the command-line page must be what
# docs/gen_cli.py makes of flor/cli.py, and MkDocs warnings are errors.
docs: setup
	$(BIN)/$(PIP) 'mkdocs==1.6.1'
	$(BIN)/python docs/gen_cli.py --check
	$(BIN)/mkdocs build --strict --site-dir build/site

# The C core in the style of .clang-format. clang-format is pinned (versions
# lay code out differently); it is a small wheel with no dependencies, so it
# needs the venv, not the rest of setup. `make format` rewrites the files.
CLANG_FORMAT := clang-format==22.1.8
C_SOURCES = csrc/*.c csrc/*.h

format-check: $(BIN)/python
	$(BIN)/$(PIP) $(CLANG_FORMAT)
	$(BIN)/clang-format --dry-run --Werror $(C_SOURCES)

format: $(BIN)/python
	$(BIN)/$(PIP) $(CLANG_FORMAT)
	$(BIN)/clang-format -i $(C_SOURCES)

bench: setup
	$(BIN)/$(PIP) --no-build-isolation -e '.[bench]'
	$(BIN)/python benchmarks/materialize.py
	$(BIN)/python benchmarks/replay.py
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf build $(VENV) $(ASAN_VENV) flor/*.so *.egg-info
