# Two commands do all setup on a fresh Debian/Ubuntu machine: `make train` and `make test`.
# Every step is idempotent: a second `make setup` only checks, and finishes in seconds.

SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMPS := .make
# Training needs an MPI, a compiler, CMake and patch (Horovod's build); where their commands are
# on PATH (a cluster's `module load` too), `make train` installs no Debian package.
TRAIN_COMMANDS := mpicc mpirun cmake g++ patch
TRAIN_APT := openmpi-bin libopenmpi-dev cmake g++ patch
# The suite needs the rest: MPICH, a Slurm cluster, sshd on namespace hosts, containers.
TEST_APT := openmpi-bin libopenmpi-dev mpich libmpich-dev cmake g++ patch slurm-wlm munge \
    openssh-server openssh-client iproute2 podman runc mmdebstrap libfaketime
PYTEST_ARGS ?=
# pytest-xdist workers, one per core and at least two: the suite waits on launches, timeouts and
# daemons a third of the time when run in one process (measured: 36% of 2 cores idle); two
# workers keep both cores busy, and three on 2 cores were no faster (docs/development.md).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 2 ] && echo $$n || echo 2)
XDIST := -n $(TEST_WORKERS) --dist loadgroup
TRAIN_ARGS ?=

# Open MPI refuses to run as root unless told; CI and containers run as root.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif
comma := ,
# horovodrun and mpirun from the virtual environment come first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup test-setup system-packages test-system-packages horovod bytecode train train-lm doctor image test \
    test-fast lint gpu-check clean

setup: system-packages $(STAMPS)/python-packages horovod bytecode
test-setup: setup test-system-packages $(STAMPS)/test-packages
	@$(MAKE) --no-print-directory bytecode  # the suite's packages too, installed after setup's compiling

# Debian packages, each list installed only where one is missing (a second run needs no apt), as
# root or with sudo; else one line naming them. HVDKIT_SKIP_APT=1 skips both.
APT_INSTALL = if [ "$(HVDKIT_SKIP_APT)" = 1 ]; then echo "setup: HVDKIT_SKIP_APT=1, not installing Debian packages"; \
	exit 0; fi; missing=$$(for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=sudo; \
	else echo "setup: missing Debian packages:" $$missing "- install them as root$(2)" >&2; exit 1; fi; \
	echo "setup: installing Debian packages:" $$missing; \
	$$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q $$missing

system-packages:
	@ok=1; for c in $(TRAIN_COMMANDS); do command -v $$c >/dev/null || ok=0; done; [ $$ok = 1 ] && exit 0; \
	$(call APT_INSTALL,$(TRAIN_APT),$(comma) or load your cluster's MPI and compilers (module load) and rerun)

test-system-packages:
	@$(call APT_INSTALL,$(TEST_APT),: the suite starts a Slurm cluster$(comma) namespace hosts and containers)

$(PY):
	$(PYTHON) -m venv $(VENV)

# --no-compile: pip's compiling made torch's install take 119 s instead of 77 s; `bytecode` below
# compiles everything once, faster, on both cores.
PIP_INSTALL := $(PY) -m pip install -q --no-compile

# Re-run pip only when what it installs changes; the suite's own packages (pytest, the trackers,
# Jupyter's) only for `make test`.
$(STAMPS)/python-packages: setup.cfg pyproject.toml constraints.txt | $(PY)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -c constraints.txt torch torchvision
	$(PIP_INSTALL) -c constraints.txt -e .
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/test-packages: $(STAMPS)/python-packages
	$(PIP_INSTALL) -c constraints.txt -e '.[test]'
	@mkdir -p $(STAMPS) && touch $@

# Builds Horovod against the installed torch, or installs the cached wheel, or does nothing.
horovod: system-packages $(STAMPS)/python-packages
	$(PY) -m hvdkit.build

# Bytecode for every installed module, made again only when site-packages gained or lost an entry
# (a package installed, upgraded or removed). Python writes it on first import only where
# PYTHONDONTWRITEBYTECODE is unset; where it is set (this machine), every rank compiled torch,
# torchvision and sympy at each start: importing them took 14 s, with bytecode 5.7 s.
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
bytecode: $(STAMPS)/python-packages horovod
	@site=$(SITE); if [ -e $(STAMPS)/bytecode ] && [ -z "$$(find "$$site" -maxdepth 1 -newer $(STAMPS)/bytecode)" ]; \
	then exit 0; fi; echo "setup: compiling $$site"; \
	$(PY) -m compileall -q -j0 -x 'torch/testing/_internal/py312_intrinsics' "$$site" && touch $(STAMPS)/bytecode

doctor: setup
	$(VENV)/bin/hvdkit doctor --selftest

# hvdkit's container image (Dockerfile), built by podman or docker; its tag is the last line.
# IMAGE_BASE=local: a Debian base made here with mmdebstrap, for machines that reach no registry.
IMAGE_BASE ?= debian:bookworm
IMAGE_ARGS ?=
image: setup
	$(VENV)/bin/hvdkit image build --base $(IMAGE_BASE) $(IMAGE_ARGS)

# The main job: 2 ranks on this machine, the embedded digits dataset, the default config.
train: setup
	$(VENV)/bin/hvdkit launch --launcher horovodrun -np 2 -- $(VENV)/bin/hvdkit train $(TRAIN_ARGS)

# The language model: 2 ranks, the embedded text corpus, AdamW, warmup + cosine, bf16.
train-lm: setup
	$(VENV)/bin/hvdkit launch --launcher horovodrun -np 2 -- $(VENV)/bin/hvdkit train --model gpt-tiny --dataset text \
	    --optimizer adamw --base-lr 2e-3 --lr-scaling none --epochs 2 --warmup-epochs 0.1 --weight-decay 0.1 \
	    --clip-grad-norm 1.0 --amp $(TRAIN_ARGS)

# The whole suite, what CI runs; it ends with the 15 slowest tests, so that growth is seen.
test: test-setup
	$(PY) -m pytest tests $(XDIST) --durations=15 $(PYTEST_ARGS)

# The inner loop: the unit tests and one real 2-rank run of each launcher (horovodrun with
# Gloo and MPI, mpirun, srun on the test Slurm cluster), in under 4 minutes.
test-fast: test-setup
	$(PY) -m pytest tests -m "not slow or fast" $(XDIST) --durations=5 $(PYTEST_ARGS)

# pyflakes, pycodestyle, bugbear and import-order checks at 120 columns; the tests' helper
# modules (conftest and the workers beside it) are first-party. ruff comes from setup.cfg's lint extra.
# Its own exclusions are replaced: they skip any folder named build, which is hvdkit/build.
lint: $(STAMPS)/python-packages
	@$(PY) -m ruff --version >/dev/null 2>&1 || $(PIP_INSTALL) -c constraints.txt -e '.[lint]'
	$(PY) -m ruff check --isolated --config "src = ['.', 'tests']" --config "exclude = ['.git', '.venv', '.gpu', 'runs']" \
	    --select E,F,W,B,I --line-length 120 --output-format concise .

# On a CUDA machine: Horovod with NCCL, the tests marked gpu, the synthetic benchmark beside
# Horovod's loop and DDP, one summary (hvdkit/checks/gpucheck.py). On an offline node whose Python
# already has torch: make gpu-check GPU_PYTHON=/usr/bin/python3 GPU_CHECK_ARGS="--sdist FILE".
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
gpu-check:
	@if [ -z "$(GPU_PYTHON)" ]; then $(MAKE) --no-print-directory -s system-packages $(STAMPS)/python-packages; fi
	$(or $(GPU_PYTHON),$(PY)) -m hvdkit.checks.gpucheck $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(STAMPS) *.egg-info
