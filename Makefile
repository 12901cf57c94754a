# Two commands set everything up on a fresh machine: `make demo` and `make test`.
#
# tools/make_venv.py creates .venv. Where `python3` already has torch (a GPU machine's venv,
# conda env or container), .venv is layered over that Python and reuses its torch and other
# packages as they are: nothing is replaced or downloaded again. Elsewhere torch is installed
# with dptrain, pinned to the CPU build that pip finds on these machines
# (torch==2.13.0): letting pip resolve `torch>=2.4` by itself would pull a CUDA build of several GB.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test check venv clean bench

$(VENV)/.installed: pyproject.toml tools/make_venv.py
	$(PYTHON) tools/make_venv.py --venv "$(VENV)" --torch "$(TORCH_PIN)"
	@touch $@

venv: $(VENV)/.installed

# DEMO_ARGS: extra flags for the demo (e.g. `make demo DEMO_ARGS="--num_epochs 2"`).
DEMO_ARGS ?=

demo: venv
	$(BYTECODE) $(VENV)/bin/dptrain run --nproc-per-node 2 examples/image_classification.py $(DEMO_ARGS)
	@echo ""
	@echo "Next: dptrain, torchrun and a python that imports dptrain are in $(VENV). Type"
	@echo "    source $(VENV)/bin/activate"
	@echo "    dptrain run --nproc-per-node 2 examples/six_steps.py"
	@echo "(or call $(VENV)/bin/dptrain and $(VENV)/bin/python directly; README.md, Quick start)"

# The whole suite, what CI runs. With pytest-xdist (a test dependency) the tests run on JOBS
# workers (default: one per CPU, and one more where there are only one or two: many tests wait
# on a timeout, a peer or a killed rank, and a third worker computes meanwhile);
# tests/conftest.py keeps the ones that must not overlap on one worker. Without xdist they run
# one after another. `make check` is the inner loop's subset (CONTRIBUTING.md).
JOBS ?= $(shell $(PY) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1; print(n + 1 if n <= 2 else n)")
XDIST = $(shell $(PY) -c "import xdist" >/dev/null 2>&1 && echo "-n $(JOBS) --dist loadgroup")

# Bytecode: where PYTHONDONTWRITEBYTECODE is set (CI images often set it) no process would write
# any, and each of the suite's hundreds of interpreters compiled torch, dptrain and the tests
# from source again (2 s of CPU each). tools/make_venv.py writes none either (pip's --no-compile:
# compiling all 16,500 files pip installs took 24 s on two cores, most never imported). So the
# targets below run with bytecode writing on: the first process that imports a module writes its
# bytecode into .venv or the checkout (atomically: concurrent writers are safe), every later one
# reads it.
BYTECODE = env -u PYTHONDONTWRITEBYTECODE

test: venv
	$(BYTECODE) $(PY) -m pytest -q -p no:cacheprovider --durations=25 $(XDIST) tests

check: venv
	$(BYTECODE) $(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not slow" tests

bench: venv
	$(PY) benchmarks/ddp_step.py

clean:
	rm -rf $(VENV) build *.egg-info

# PyTorch's own DDP and DistributedSampler tests from the installed wheel, run against dptrain's
# classes (gloo, 2 ranks, spawned; about 25 minutes on 2 cores): not part of `make test`.
# See tests/torch_suite/run_torch_suite.py; its last result is in benchmarks/RESULTS.md.
.PHONY: test-torch-suite
test-torch-suite: venv
	@$(PY) -c "import expecttest" >/dev/null 2>&1 || $(PY) -m pip install -q expecttest
	$(PY) tests/torch_suite/run_torch_suite.py
