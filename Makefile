# The README's two commands: `make demo` and `make test`. Each creates .venv
# when missing and installs what it needs, so a fresh machine needs only
# Python 3.11 and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp

.PHONY: demo batch-demo test stress redteam lint bench clean postgresql system-packages interop interop-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# One stamp per extra set; pyproject.toml changes reinstall.
$(STAMP)-base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(STAMP)-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

$(STAMP)-postgres: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[postgres]'
	touch $@

$(STAMP)-mcp: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[mcp]'
	touch $@

$(STAMP)-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	touch $@

# The research agent: one real session with parallel calls (fs, web, python), an error
# observation, results in declared order and a transcript on disk; no API key needed.
demo: $(STAMP)-base
	$(BIN)/python examples/research_agent.py

# A batch eval, offline (docs/batch.md): 200 tasks, 50 at a time, failing tools, a
# failing model and a hang; run it again and it has nothing to do.
batch-demo: $(STAMP)-base
	$(BIN)/python examples/batch_eval.py "$${XDG_CACHE_HOME:-$$HOME/.cache}/tak-batch-demo"

# The PostgresStore tests (and bench) start their own server from Debian's
# binaries, and the browser tests (tests/web) drive Debian's chromium: install
# what is missing, as root with apt-get (one `apt-get update`, one install);
# else those tests skip with the reason. Nothing happens when both are there.
system-packages:
	@missing=""; \
	if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then missing="$$missing postgresql"; fi; \
	if ! command -v chromium >/dev/null 2>&1; then missing="$$missing chromium"; fi; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else \
	    echo "missing:$$missing and not root: the tests needing them will skip"; \
	  fi; \
	fi

postgresql: system-packages

# TAK_WEB_REQUIRED: where chromium is installed, the browser tests (tests/web) must run, not skip.
# Two test processes per core (pytest-xdist): many tests wait on subprocesses, sockets
# and fsyncs, so one per core leaves a core idle a third of the time (2 cores: 12 min 43 s
# with 2 processes, 9 min 6 s with 4, 11 min 14 s with 6). The 15 slowest tests are
# printed at the end.
TEST_PROCESSES ?= $(shell echo $$(( 2 * $$(nproc 2>/dev/null || echo 1) )))
test: $(STAMP)-test system-packages
	TAK_WEB_REQUIRED=$$(command -v chromium >/dev/null 2>&1 && echo 1) $(BIN)/python -m pytest -q -m "not stress" -p no:cacheprovider --durations=15 -n $(TEST_PROCESSES)

stress: $(STAMP)-test system-packages
	$(BIN)/python -m pytest -q --stress -p no:cacheprovider

# The adversarial suite alone (it also runs in `make test`); prints `redteam: N/M refused`.
redteam: $(STAMP)-test
	$(BIN)/python -m pytest -q tests/security -p no:cacheprovider

# Opt-in, not part of `make test`: the kernel against llama.cpp's llama-server
# (built from the llama-cpp-python sdist on first use, cached in .interop/,
# a few minutes on 2 cores) serving SmolLM2-135M-Instruct. docs/models.md.
interop-tools:
	@if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake g++ ninja-build; \
	  else \
	    echo "cmake and g++ are needed to build llama-server"; exit 1; \
	  fi; \
	fi

interop: $(STAMP)-test interop-tools
	$(BIN)/python -m pytest -q -s --interop tests/interop -p no:cacheprovider

lint: $(STAMP)-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)-postgres $(STAMP)-mcp postgresql
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis .interop
