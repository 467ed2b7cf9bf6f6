# Developer entry points. `make test` and `make test-oldest` are what CI runs (via .ci/run).
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp
EXAMPLES_STAMP := $(VENV)/.stamp-examples
# torch is pinned to the CPU build that pip finds locally; an unpinned
# `pip install torch` would pull a multi-GB CUDA build from PyPI.
TORCH_PIN := torch==2.13.0

# The oldest supported torch (pyproject.toml's torch>=), tested by `make
# test-oldest` in a venv of its own. PyPI has only CUDA builds of it for Linux:
# the torch wheel (~530 MB) and its nvidia-* wheels (~3 GB installed), all
# cached by pip after the first build; the CPU tests never load a GPU.
TORCH_OLDEST := 2.11.0
OLDEST_VENV  := .venv-oldest
# The newest torch release, tested by `make test-newest` on the same tests as
# test-oldest (a CUDA build from PyPI too, ~540 MB plus its nvidia-* wheels, run
# on the CPU). The pip configuration of these machines caps torch below it with a
# constraint file: that venv installs through .ci/pip-uncapped, which passes every
# other pip setting as a PIP_* variable and reads no configuration file.
TORCH_NEWEST := 2.15.0
NEWEST_VENV  := .venv-torch-$(TORCH_NEWEST)
# What `make test-oldest` runs: the guard and the torch-sensitive paths (staging
# pool, version counters, the views' autograd node, composable state, DTensor/DCP checkpoints, TP's
# _StridedShard, MemTracker, the planner's fake tensors, pipelining, fp8/int8 wire codecs, DeviceMesh's
# process-group cache at exit, the optimizers' functional forms and state initialisation of
# flat_step, the blocked-rank watcher's view of torch's frames, FSDP2's comm protocols, FSDP2's
# method set and policy fields, what torch's MixedPrecisionPolicy means on that torch, manual
# finalization) plus parity and collective counts; ~10 min on 2 cores. OLDEST_TESTS=tests for all.
OLDEST_TESTS ?= tests/repository/test_torch_private.py tests/buffers/test_staging_pool.py tests/buffers/test_param_views.py \
	tests/core/test_parity.py \
	tests/runtime/test_collectives_and_memory.py tests/runtime/test_bucketing.py tests/checkpoint/test_checkpoint_model.py \
	tests/checkpoint/test_checkpoint_flat.py tests/checkpoint/test_checkpoint_optim.py tests/parallelism/test_tensor_parallel.py \
	tests/tools/test_mem_tracker.py tests/parallelism/test_pipeline.py tests/parallelism/test_composition.py \
	tests/core/test_module_api.py tests/checks/test_errors.py tests/parallelism/test_moe.py tests/parallelism/test_spmd_mesh.py \
	tests/runtime/test_quantized_wire.py tests/runtime/test_quantized_collectives.py tests/core/test_exit.py \
	tests/core/test_flat_step.py tests/core/test_optimizer_state_init.py tests/checks/test_blocked_rank.py tests/core/test_fsdp2_methods.py \
	tests/core/test_fsdp2_compat.py tests/core/test_torch_mixed_precision.py tests/core/test_manual_finalization.py

.PHONY: venv test test-oldest test-newest test-torch test-gpu demo lora-demo bench bench-report clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@$(VPY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install --no-input $(TORCH_PIN)
	$(VENV)/bin/pip install --no-input -q -e '.[test,hf,lightning,trl]' '$(TORCH_PIN)'
	@touch $@

# The tests run in TEST_WORKERS pytest processes (pytest-xdist), a test file to each
# (--dist loadfile: a file's cached runs and module fixtures are made once). Three on 2
# cores overlap the tests that wait (timeouts, late ranks, torchrun jobs, ranks waiting for
# each other in a collective) with those that compute: the cores stay busy (96% against 86%
# with two, the same CPU seconds). TEST_WORKERS=0: one process (what `-p tests._cputime`
# needs to see every test).
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The tests, the layer contracts (import-linter: tests/repository/test_layers.py) and the
# type checker (mypy, [tool.mypy] in pyproject.toml: tests/repository/test_types.py) among
# them, so that both run beside the other tests.
test: venv
	$(VPY) -m pytest -q $(XDIST) --durations=15 $(PYTEST_ARGS)

# The tests on the oldest supported torch (TORCH_OLDEST), in $(OLDEST_VENV).
test-oldest:
	$(MAKE) test-torch TORCH_VERSION=$(TORCH_OLDEST) TORCH_VENV=$(OLDEST_VENV) \
		PYTEST_ARGS="$(OLDEST_TESTS) $(PYTEST_ARGS)"

# The same tests on the newest torch pip installs (TORCH_NEWEST), in $(NEWEST_VENV).
test-newest:
	$(MAKE) test-torch TORCH_VERSION=$(TORCH_NEWEST) TORCH_VENV=$(NEWEST_VENV) \
		TORCH_PIP=".ci/pip-uncapped $(NEWEST_VENV)/bin/pip" PYTEST_ARGS="$(OLDEST_TESTS) $(PYTEST_ARGS)"

# The tests on any torch pip installs: make test-torch TORCH_VERSION=2.14.1
# (venv .venv-torch-2.14.1; PYTEST_ARGS picks tests, default all; TORCH_PIP the pip
# that installs into it).
TORCH_VENV ?= .venv-torch-$(TORCH_VERSION)
TORCH_PIP  ?= $(TORCH_VENV)/bin/pip
test-torch:
	@test -n "$(TORCH_VERSION)" || { echo "usage: make test-torch TORCH_VERSION=2.x.y"; exit 2; }
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	@$(TORCH_VENV)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" \
		2>/dev/null || $(TORCH_PIP) install --no-input -q 'torch==$(TORCH_VERSION)'
	@test -f $(TORCH_VENV)/.stamp -a $(TORCH_VENV)/.stamp -nt pyproject.toml || { \
		$(TORCH_PIP) install --no-input -q -e '.[test,hf]' 'torch==$(TORCH_VERSION)' && \
		touch $(TORCH_VENV)/.stamp; }
	$(TORCH_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(TORCH_VENV)/bin/lint-imports
	$(TORCH_VENV)/bin/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The CUDA mode of the suite: GPU_TESTS with FSDP_COMPOSE_TEST_DEVICE=cuda (models and
# batches on the GPU, the ranks of each test sharing the visible GPU(s) over gloo, the
# one-process references on the same GPU; tests/core/test_cuda.py adds NCCL at world size 1
# and GPU memory). Needs a torch with CUDA: GPU_PYTHON=python3 to use another interpreter.
# Without a CUDA device it says so and exits 0 without running (nothing passed).
GPU_PYTHON ?= $(VPY)
GPU_TESTS ?= tests/core/test_cuda.py tests/core/test_parity.py tests/core/test_mixed_precision.py \
	tests/runtime/test_collectives_and_memory.py tests/runtime/test_prefetch.py tests/tools/test_split_root.py \
	tests/core/test_clip.py tests/runtime/test_bucketing.py tests/core/test_grad_scaler.py tests/tools/test_hf_trainer.py
test-gpu:
	@if $(GPU_PYTHON) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		echo FSDP_COMPOSE_TEST_DEVICE=cuda $(GPU_PYTHON) -m pytest -q $(GPU_TESTS) $(PYTEST_ARGS); \
		FSDP_COMPOSE_TEST_DEVICE=cuda $(GPU_PYTHON) -m pytest -q $(GPU_TESTS) $(PYTEST_ARGS); \
	else \
		echo "make test-gpu: no CUDA device visible to $(GPU_PYTHON); the CUDA mode did not run (nothing passed)"; \
	fi

# Train a small GPT on 2 CPU ranks (~10 s once the venv is built): progress bar,
# summary table, and summary.json + a loss/memory plot (with matplotlib) under
# runs/train_gpt-<time>. More options: DEMO_ARGS="--compare" (the same steps with
# torch DDP and FSDP2), "--steps 200 --warmup 20 --min-lr-ratio 0.1",
# "--mixed-precision bf16", ... (--help).
demo: $(EXAMPLES_STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py $(DEMO_ARGS)

# The `examples` extra (tqdm, matplotlib), installed once per pyproject.toml change.
$(EXAMPLES_STAMP): $(STAMP) pyproject.toml
	$(VENV)/bin/pip install --no-input -q -e '.[examples]' '$(TORCH_PIN)'
	@touch $@

# LoRA fine-tuning of a small Hugging Face Llama (PEFT) on 2 CPU ranks; ~1 min.
lora-demo: venv
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/lora_finetune.py

# Compare fsdp_compose with DDP, FSDP2 and FSDP1 (see BENCHMARKS.md); ~10 min.
# BENCH_ARGS=--quick for a ~1 min smoke run, or e.g. BENCH_ARGS="--scenario many-small".
bench: venv
	$(VENV)/bin/pip install --no-input -q -e '.[bench]'
	$(VPY) -m benchmarks.run $(BENCH_ARGS)

# BENCHMARKS.md's tables from the records in benchmarks/results/record/ (no benchmark runs).
bench-report:
	PYTHONPATH=. $(if $(wildcard $(VPY)),$(VPY),$(PYTHON)) -m benchmarks.record

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	rm -rf .mypy_cache
	find . -path './.venv*' -prune -o -name __pycache__ -type d -exec rm -rf {} +
