# Two entry points do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= .cache
MODEL ?= $(HOME)/.cache/pitstop/tiny-llama
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint venv model clean rootfs

venv: $(VENV)/.installed

# torch comes first from the local CPU wheel of this machine kind: asked for
# through the dependency list alone, pip would fetch a multi-GiB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --find-links /opt/wheels 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

model: venv
	$(BIN)/pitstop make-model $(MODEL)

run: venv model
	$(BIN)/pitstop run

lint: venv
	$(BIN)/ruff check agent tests bench

# Debian rootfs trees booted by systemd-nspawn: the real systemd the unit tests drive
# (LAB.md fact 8). Debian 12 is the one the tests boot; Debian 13 boots the same way, and its
# CRIU 4.1 runs the units' checkpoint test (through its own loader, from the Debian 12
# container). The script returns at once when its stamp matches.
rootfs:
	scripts/make-rootfs.sh bookworm $(CACHE)/rootfs/bookworm
	scripts/make-rootfs.sh trixie $(CACHE)/rootfs/trixie criu

test: venv rootfs
	$(BIN)/ruff check agent tests bench
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) $(CACHE)
