# Two commands set everything up on a fresh machine: `make demo` and `make test`.
#
# Torch is installed first and on its own, pinned to the CPU build that pip finds on these
# machines (torch==2.13.0): letting pip resolve `torch>=2.3` by itself would pull a CUDA
# build of several GB. A torch that the system Python already has (a GPU user's) is reused:
# the virtual environment then sees the system's packages.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test venv clean bench

$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "reusing the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	    $(PYTHON) -m venv $(VENV); \
	fi
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[examples,test]"
	@touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/dptrain run --nproc-per-node 2 examples/image_classification.py

test: venv
	$(PY) -m pytest -q -p no:cacheprovider tests

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
