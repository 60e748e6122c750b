# Two set-up commands for a fresh clone: `make serve` and `make test`.
# Both install from requirements.lock (pins for the whole environment, made by `make lock`),
# `make serve` only what serving needs, `make test` the tools and test dependencies too.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
LOCK   := requirements.lock
PIP    := $(PY) -m pip install --quiet --constraint $(LOCK)
SERVE_EXTRAS := torch,server,onnx,embeddings,generation
TEST_EXTRAS  := $(SERVE_EXTRAS),tools,otel,dev,ray
SERVE_STAMP  := $(VENV)/.serve-installed
TEST_STAMP   := $(VENV)/.test-installed
# pytest-xdist workers: one per core (2 on CI); PYTEST_WORKERS=0 runs in one process.
# --dist loadscope keeps a module's tests on one worker, so a module's server starts once.
PYTEST_WORKERS ?= auto

.PHONY: serve test lint bench lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml $(LOCK) | $(PY)
	$(PIP) -e '.[$(SERVE_EXTRAS)]'
	touch $@

$(TEST_STAMP): pyproject.toml $(LOCK) | $(PY)
	$(PIP) -e '.[$(TEST_EXTRAS)]'
	touch $@ $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(PY) -m carpool.cli serve

test: $(TEST_STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

bench: $(TEST_STAMP)
	$(PY) benchmarks/bench_core.py

# Re-resolve every extra's dependencies at their newest allowed versions into the lock.
# torch is written as 2.13.0 (the CPU build's local "+cpu" is not a PyPI release).
lock: | $(PY)
	$(PY) -m pip install --quiet 'pip-tools>=7.4'
	CUSTOM_COMPILE_COMMAND='make lock' $(PY) -m piptools compile --quiet --allow-unsafe --strip-extras --all-extras \
		--no-emit-index-url --no-emit-find-links --output-file $(LOCK) pyproject.toml
	sed -i 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/' $(LOCK)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
