# slackswap: `make demo` runs the main job on a shipped sample, `make test` runs the tests.
# Both build a local virtualenv in .venv. torch: if the interpreter that makes the venv already
# has a torch (say a CUDA build), the venv sees it (--system-site-packages) and keeps it;
# otherwise the CPU build torch==$(TORCH_VERSION) is installed. torchvision (timm needs it; the zoo
# builds its models): the release that goes with that torch, and for a CPU torch PyPI's wheel
# rewritten without its CUDA-linked C++ ops, which would stop `import torchvision`
# (slackswap_testkit/torchvision_wheel.py says why).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slackswap-installed

.PHONY: install demo test test-slow test-all test-3d test-torch test-emulated fuzz samples bench zoo gpu-truth clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -c "import torchvision" 2>/dev/null || $(PY) -m slackswap_testkit.torchvision_wheel --install
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/slackswap profile examples/tiny_gpt.py -o out/tiny_gpt.profile.json
	$(VENV)/bin/slackswap plan sample_profiles/gpt2-xl.json --budget 0.5 -o out/gpt2-xl.plan.json
	$(VENV)/bin/slackswap compare sample_profiles/gpt2-xl.json --budget 0.5 \
		--planners slackswap,recompute-only,swap-all,checkpoint-layers

# The tests run in TEST_WORKERS processes (pytest-xdist; most tests are one thread of Python,
# so two processes use this 2-core machine's second core); `TEST_WORKERS=0` runs them in one.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST)

# The slow tier: tests marked slow_tier (more models, steps, ranks or budgets of what a default
# test checks; tests/conftest.py skips them unless SLACKSWAP_SLOW=1). `make test-all`: both.
test-slow: install
	SLACKSWAP_SLOW=1 $(PY) -m pytest -q $(XDIST) -m slow_tier

test-all: install
	$(VENV)/bin/ruff check .
	SLACKSWAP_SLOW=1 $(PY) -m pytest -q $(XDIST)

# FSDP2 x TP x PP on 8 gloo ranks (tests/test_three_d.py, slow tier): minutes on two cores,
# so run under nice; `python benchmarks/three_d_ranks.py` prints its per-rank table.
test-3d: install
	SLACKSWAP_SLOW=1 timeout 1800 nice -n 19 $(PY) -m pytest -q tests/test_three_d.py

# The tests on another torch, in a virtualenv of its own: `make test-torch TORCH=2.15.0` builds
# .venv-torch-2.15.0 (no system site packages) with PyPI's torch==$(TORCH) and the project's
# other dependencies, then runs the suite there. PyPI's Linux x86_64 wheels are CUDA builds
# (the venv is about 5.3 GB) that run on a CPU. Never part of `make test` or CI.
# PIP_CONSTRAINT=/dev/null: a constraints file pinning the CI torch would refuse this one;
# torch==$(TORCH) is passed again with the project so pip keeps it.
TORCH ?=
TORCH_VENV := .venv-torch-$(TORCH)

test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.15.0" >&2; exit 2; }
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$(TORCH)')" 2>/dev/null \
		|| PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH)"
	PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/python -m pip install -q -e ".[dev]" "torch==$(TORCH)"
	$(TORCH_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The swap engine's CUDA path on the emulated asynchronous device (docs/runtime.md, "The swap
# engine"): every case bitwise against eager (`make test` runs a subset), then the mutation
# check (benchmarks/sync_mutants.py, minutes: each synchronization taken out in turn).
test-emulated: install
	SLACKSWAP_SLOW=1 $(PY) -m pytest -q tests/test_emulated_device.py
	$(PY) benchmarks/sync_mutants.py

# 3000 structurally mutated profiles, plans and hardware files (about a minute of CPU).
fuzz: install
	SLACKSWAP_FUZZ_MANY=1 $(PY) -m pytest -q tests/test_fuzz_loaders.py

# Regenerate the shipped sample profiles (fake tensors, roofline on a100-pcie4).
samples: install
	$(VENV)/bin/slackswap profile examples/bert_large.py --device fake --hardware a100-pcie4 -o sample_profiles/bert-large.json
	$(VENV)/bin/slackswap profile examples/gpt2_xl.py --device fake --hardware a100-pcie4 -o sample_profiles/gpt2-xl.json
	$(VENV)/bin/slackswap profile examples/llama_7b.py --device fake --hardware a100-pcie4 -o sample_profiles/llama-7b.json
	$(VENV)/bin/slackswap profile examples/resnet50.py --device fake --hardware a100-pcie4 -o sample_profiles/resnet50.json
	$(PY) -m slackswap_testkit.sample_paths sample_profiles/*.json

# Every benchmark in benchmarks/, each writing its numbers to benchmarks/results/ (slow: paper_table
# and local_search run the MILP with a time limit of up to a minute per case).
# The model zoo is left to `make zoo`. gpu_check.py needs a CUDA GPU: skipped, saying so, where there is none. fidelity.py runs twice:
# its memory rows, then (--step-time) predicted vs measured step time on this CPU.
bench: install
	@set -e; for b in benchmarks/*.py; do \
	  case $$b in benchmarks/zoo*.py) echo "skipping $$b: \`make zoo\` runs it (an hour)"; continue;; esac; \
	  if [ "$$b" = benchmarks/gpu_check.py ] && ! $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
	    echo "skipping $$b: needs a CUDA GPU (\`$(PY) $$b --dry-run\` runs it on the CPU with a tiny model)"; \
	    continue; fi; \
	  echo "== $(PY) $$b"; $(PY) $$b; \
	done
	$(PY) benchmarks/fidelity.py --step-time

# The model zoo (benchmarks/zoo.py): timm, Hugging Face transformers, diffusers and torchvision
# models planned at budget 0.5 and trained 3 AdamW steps patched against eager; writes
# benchmarks/results/zoo.csv and zoo.md. ZOO_ARGS: e.g. --library timm, --only a,b, --resume.
zoo: install
	$(PY) benchmarks/zoo.py $(ZOO_ARGS)

# The op cost constants against measured GPU steps (torch-free, seconds): the fit reproduces
# slackswap_cli/op_costs.json, then the leave-one-GPU-out table (benchmarks/results/gpu_truth.md).
# benchmarks/gpu_truth_profiles.py re-traces the measured models (minutes) when they change.
# gpu_truth_l2.py holds the per-op files against the L2 rule (benchmarks/results/gpu_truth_l2.md).
gpu-truth: install
	$(PY) benchmarks/fit_costs.py --check
	$(PY) benchmarks/gpu_truth.py
	$(PY) benchmarks/gpu_truth_l2.py

clean:
	rm -rf $(VENV) out .pytest_cache
	@ls -d .venv-torch-* 2>/dev/null | sed 's/^/left in place (make test-torch): /' || true
