# Every target does its own set-up: a fresh machine needs nothing but Python 3.11.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Set-up is done once, and again only when a dependency file is newer than this stamp.
STAMP := $(VENV)/.installed
INSTALL := $(BIN)/pip install -q -c constraints.txt
LINTED := partitioner passes runtime

.PHONY: setup demo test test-slow test-fast lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(INSTALL) pip setuptools
	$(INSTALL) --no-build-isolation -e '.[test,dev]'
	touch $@

setup: $(STAMP)

# The main job on an embedded default: a GPT auto-parallelized on 4 local gloo ranks, trained next to one process.
demo: setup
	$(BIN)/python -m partitioner demo

# Three workers (pytest-xdist) on 2 cores: a multi-process test's ranks spend much of their time
# waiting (for rank 0's plan, in collectives, on timeouts a test provokes), so with two workers the
# cores stood idle about half the run (quiet 2-core machine: 648 s wall for ~740 CPU-s); with three,
# 410 s wall for ~780 CPU-s.
# The everyday tier: every test but the slow tier's.
test: setup
	$(BIN)/python -m pytest tests -n 3 -m "not slow" --durations=15

# The slow tier: more models through paths the everyday tier covers, torchrun and two hosts. CI runs both.
test-slow: setup
	$(BIN)/python -m pytest tests -n 3 -m slow --durations=15

# The fast tier: everything but the tests that start processes (ranks, CLI subprocesses).
test-fast: setup
	$(BIN)/python -m pytest tests -n 2 -m "not multiproc"

# Every check runs, and the target fails if any of them did.
lint: setup
	@status=0; \
	$(BIN)/ruff check $(LINTED) || status=1; \
	$(BIN)/ruff format --check $(LINTED) || status=1; \
	$(BIN)/mypy $(LINTED) || status=1; \
	exit $$status

bench: setup
	$(BIN)/python benchmarks/plan_time.py
	$(BIN)/python benchmarks/plan_quality.py
	$(BIN)/python benchmarks/runtime_overhead.py
	$(BIN)/python benchmarks/memory_cap.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/convergence.py
	$(BIN)/python benchmarks/char_lm.py

clean:
	rm -rf $(VENV) out
