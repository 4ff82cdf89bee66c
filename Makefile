# Every target does its own set-up: a fresh machine needs nothing but Python 3.11.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

setup: $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'

# The main job on an embedded default: a GPT auto-parallelized on 4 local gloo ranks, trained next to one process.
demo: setup
	$(BIN)/python -m partitioner demo

test: setup
	$(BIN)/python -m pytest tests

bench: setup
	$(BIN)/python benchmarks/plan_time.py
	$(BIN)/python benchmarks/plan_quality.py
	$(BIN)/python benchmarks/runtime_overhead.py
	$(BIN)/python benchmarks/memory_cap.py
	$(BIN)/python benchmarks/pipeline.py

clean:
	rm -rf $(VENV) out
