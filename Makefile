# Two entry points do all the set-up: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= .cache
MODEL ?= $(HOME)/.cache/pitstop/tiny-llama
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test setup setup-python setup-system lint venv vllm model criu criu-bundle criu-cuda-plugin \
	clean prometheus docs-images rootfs rootfs-trixie ansible ansible-hosts ansible-roots wheelhouse \
	bench-front

venv: $(VENV)/.installed

# The reference extra (torch & co.: the reference engine that `make run` serves, and the
# tests) and the s3 extra (boto3: snapshots in an S3 store) on top of the agent; the dev
# extra brings the test tools, among them the S3-compatible server the tests start. torch comes first from the local CPU wheel of this machine
# kind: asked for through the dependency list alone, pip would fetch a multi-GiB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --find-links /opt/wheels 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[reference,s3,dev]'
	touch $@

# Real vLLM (CPU build) in a venv of its own, for tests/test_vllm_engine.py; cached by a stamp
# under $(CACHE), about 2 min the first time.
vllm:
	scripts/install-vllm.sh

# CRIU >= 4.2 at $(CACHE)/criu/bin/criu (scripts/install-criu.sh says why); idempotent.
criu: $(CACHE)/criu/.installed

$(CACHE)/criu/.installed: scripts/install-criu.sh
	scripts/install-criu.sh
	touch $@

# A self-contained CRIU (binary, ld.so, libraries) to carry to a GPU host.
criu-bundle: criu
	scripts/install-criu.sh bundle .gpu/criu

# CRIU's CUDA plugin (cuda_plugin.so), which vLLM's own `vllm snapshot` needs and Debian's criu
# packages do not ship: built from Debian's CRIU 4.2.1 source into $(CACHE)/criu-cuda-plugin.
# Only for GPU hosts that use the vllm-snapshot rung (and its bench); the tests do not need it.
criu-cuda-plugin:
	scripts/build-criu-cuda-plugin.sh $(CACHE)/criu-cuda-plugin

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

run: venv model criu
	$(BIN)/pitstop run

lint: venv
	$(BIN)/ruff check agent tests bench scripts

# A Debian 12 rootfs booted by systemd-nspawn: the real systemd the unit tests drive
# (`systemd-nspawn --register=no --keep-unit -b`: no host D-Bus needed). The script returns at once when its stamp matches. Debian 13 boots the same way
# (rootfs-trixie; not needed by the tests).
rootfs:
	scripts/make-rootfs.sh bookworm $(CACHE)/rootfs/bookworm

rootfs-trixie:
	scripts/make-rootfs.sh trixie $(CACHE)/rootfs/trixie

# The Ansible tests' hosts: Debian 12 and 13 roots with what Ansible needs on a host
# (apt bindings for Python, venv) and dpkg-dev for the test's local apt repository; Debian
# 13's criu 4.1 comes from the distribution, as on a real host. Plus a wheelhouse of the
# agent and its dependencies: the containers have no network, as hosts behind a mirror.
ANSIBLE_HOST_PACKAGES := python3-apt,python3-venv,python3-pip,dpkg-dev
ansible-hosts: ansible ansible-roots wheelhouse

ansible-roots:
	scripts/make-rootfs.sh bookworm $(CACHE)/rootfs/ansible-bookworm $(ANSIBLE_HOST_PACKAGES)
	scripts/make-rootfs.sh trixie $(CACHE)/rootfs/ansible-trixie $(ANSIBLE_HOST_PACKAGES),criu

wheelhouse:
	scripts/ansible-wheelhouse.sh $(CACHE)/ansible-wheelhouse

# promtool and the Prometheus server, from Debian's package: the rule and alert tests.
prometheus:
	bash scripts/install-prometheus.sh

# The dashboard pictures in docs/img/, from a short soak run (matplotlib: the docs extra; root,
# since the soak node mounts a tmpfs for its snapshots).
docs-images: venv prometheus model
	$(BIN)/pip install -q -e '.[docs]'
	$(BIN)/python scripts/render_dashboards.py --soak --minutes 3.5 --model $(MODEL) --out docs/img

# What the tests need, in two lanes that run at once (about half the time of one after the
# other on a clean machine: each lane waits on downloads much of its time). Within a lane one
# step at a time: two pips at once race on their shared cache (pypa/pip#12361), and apt's lock
# refuses a second apt-get rather than waiting for it.
setup:
	$(MAKE) -j2 setup-python setup-system

setup-python:
	$(MAKE) -j1 venv vllm ansible wheelhouse

setup-system:
	$(MAKE) -j1 criu prometheus rootfs ansible-roots

# --durations: every log names the slowest tests, so that a slow one is seen when it lands.
# The tests start hundreds of Python processes from this checkout (agents, engines, CLIs):
# they keep their bytecode (in __pycache__, ignored by git) even where the environment sets
# PYTHONDONTWRITEBYTECODE, instead of compiling the agent again in every process.
# Two workers (pytest-xdist), one per core: each lane of tests/lanes.py (all the vLLM tests
# are one) runs on one worker, the longest lanes handed out first, in the order given there.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/ruff check agent tests bench scripts
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -ra --durations=25 \
		-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The front against direct engine access, then a chaos run (engine SIGKILLed every 20 s);
# writes bench/results/<date>-front-cpu.md. FRONT_BENCH_ARGS to change durations.
FRONT_BENCH_ARGS ?= --seconds 10 --rounds 3 --chaos 180 --kill-every 20
bench-front: venv model
	$(BIN)/python bench/front_bench.py --model $(MODEL) $(FRONT_BENCH_ARGS)

clean:
	rm -rf $(VENV) $(ANSIBLE_VENV) $(CACHE)
