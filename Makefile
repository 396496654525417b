# Every target creates .venv if it is missing and installs the project into it.
# torch is pinned here (the package itself declares torch>=2.4): an open range would pull a CUDA build.
# torchft-nightly is pinned to the nightly tested here (a newer one may ask for a newer torch).
# ray is pinned to the release tests/test_ray.py was run with (stratagem.ray uses Ray Train's
# replica-group restarts, which are not public API).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit test-gpu bench bench-quick lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check torchft-nightly==2026.10.26
	$(BIN)/pip install -q --disable-pip-version-check ray[train]==2.60.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[examples,dev,ft,ray]'
	scripts/install-slurm.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 src > /dev/null
	$(BIN)/stratagem demo

# Three pytest workers (pytest-xdist), a test file each: launched-process tests spend much of
# their time waiting (start-up, timeouts, restarts), so three at a time fit 2 cores (two left
# 0.3 of a core idle). Beside one busy process: two workers 804 s without the Ray tests
# (which failed at once), three workers 861 s with them (6327320, one run each);
# tests/conftest.py starts the slowest files first.
# ALONE: files run after the others, one test at a time. The Ray tests start a cluster of
# daemons (GCS, four raylets, Ray Train's workers) whose start-up waits are Ray's own and
# fixed (a node gets 30 s to register); alone they take 103-112 s here (61246a6).
ALONE := tests/test_ray.py
# compileall first: the suite starts many processes (sg.launch, stratagem run, spawned ranks),
# each importing stratagem and a test module. Where PYTHONDONTWRITEBYTECODE is set (as on
# this project's machines) nothing caches their bytecode, so each process compiled them again.
test: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 src tests examples > /dev/null
	$(BIN)/python -m pytest -x -n 3 --dist loadfile --durations=15 $(ALONE:%=--ignore=%)
	$(BIN)/python -m pytest -x --durations=5 $(ALONE)

# The edit loop: the unit tier only (ranks as threads, no launched process; tests/conftest.py
# assigns the tiers and fails a unit test that starts a process). `make test` runs every tier.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -x -n 2 --dist load -m unit --durations=10

# The CUDA checks (tests/gpu), with the torch already installed (a CUDA build): no install
# step, so a GPU machine's own torch is the one tested. Skipped test by test without CUDA.
test-gpu:
	PYTHONPATH=src $(PY) -m pytest tests/gpu -rs

# Every benchmark end to end (hours; shaped links need root), each writing its canonical
# result to benchmarks/results/; the run records its own duration in results/bench.{json,md},
# after every benchmark. ARGS are passed on: in parts, ARGS="--stop-after 90" then
# ARGS=--resume (same code only); ARGS="--out-dir /tmp/b" writes elsewhere.
bench: $(STAMP)
	$(BIN)/stratagem bench $(ARGS)

# The quick profile (QUICK_PROFILE in benchmarks/_common.py): small settings on loopback, at
# most 10 minutes on 2 cores; results to a temporary folder, its timings to
# results/bench_quick.{json,md}.
bench-quick: $(STAMP)
	$(BIN)/stratagem bench --quick $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
