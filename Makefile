# Two entry points do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= .cache
MODEL ?= $(HOME)/.cache/pitstop/tiny-llama
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint venv model criu criu-bundle clean bench-front

venv: $(VENV)/.installed

# torch comes first from the local CPU wheel of this machine kind: asked for
# through the dependency list alone, pip would fetch a multi-GiB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --find-links /opt/wheels 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# CRIU >= 4.1 at $(CACHE)/criu/bin/criu (LAB.md fact 2); the script is idempotent.
criu: $(CACHE)/criu/.installed

$(CACHE)/criu/.installed: scripts/install-criu.sh
	scripts/install-criu.sh
	touch $@

# A self-contained CRIU (binary, ld.so, libraries) to carry to a GPU host.
criu-bundle: criu
	scripts/install-criu.sh bundle .gpu/criu

model: venv
	$(BIN)/pitstop make-model $(MODEL)

run: venv model criu
	$(BIN)/pitstop run

lint: venv
	$(BIN)/ruff check agent tests bench

test: venv criu
	$(BIN)/ruff check agent tests bench
	$(BIN)/python -m pytest -q -ra

# The front against direct engine access, then a chaos run (engine SIGKILLed every 20 s);
# writes bench/results/<date>-front-cpu.md. FRONT_BENCH_ARGS to change durations.
FRONT_BENCH_ARGS ?= --seconds 10 --rounds 3 --chaos 180 --kill-every 20
bench-front: venv model
	$(BIN)/python bench/front_bench.py --model $(MODEL) $(FRONT_BENCH_ARGS)

clean:
	rm -rf $(VENV) $(CACHE)
