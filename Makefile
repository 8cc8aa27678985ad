# Two entry points do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= .cache
MODEL ?= $(HOME)/.cache/pitstop/tiny-llama
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint venv model ansible clean

venv: $(VENV)/.installed

# torch comes first from the local CPU wheel of this machine kind: asked for
# through the dependency list alone, pip would fetch a multi-GiB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --find-links /opt/wheels 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Ansible and ansible-lint in their own venv: ansible-core pins its own jinja2 and
# resolvelib, and the `ansible` package (which bundles the collections) is ~0.5 GB
# that the agent never needs.
ANSIBLE_VENV ?= .venv-ansible
ansible: $(ANSIBLE_VENV)/.installed

$(ANSIBLE_VENV)/.installed: requirements-ansible.txt
	test -x $(ANSIBLE_VENV)/bin/python || $(PYTHON) -m venv $(ANSIBLE_VENV)
	$(ANSIBLE_VENV)/bin/pip install -q -r requirements-ansible.txt
	touch $@

model: venv
	$(BIN)/pitstop make-model $(MODEL)

run: venv model
	$(BIN)/pitstop run

lint: venv
	$(BIN)/ruff check agent tests bench

test: venv ansible
	$(BIN)/ruff check agent tests bench
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) $(ANSIBLE_VENV) $(CACHE)
