# Developer entry points. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp
# torch is pinned to the CPU build that pip finds locally; an unpinned
# `pip install torch` would pull a multi-GB CUDA build from PyPI.
TORCH_PIN := torch==2.13.0

.PHONY: venv test demo lora-demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@$(VPY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install --no-input $(TORCH_PIN)
	$(VENV)/bin/pip install --no-input -q -e '.[test,hf]' '$(TORCH_PIN)'
	@touch $@

# The layer contracts first (import-linter, pyproject.toml), then the tests.
test: venv
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# Train a small GPT on 2 CPU ranks (~10 s): progress bar, summary table, and
# summary.json + a loss/memory plot (with matplotlib) under runs/train_gpt-<time>.
# More options: DEMO_ARGS="--compare" (the same steps with torch DDP and FSDP2),
# "--steps 200 --warmup 20 --min-lr-ratio 0.1", "--mixed-precision bf16", ... (--help).
demo: venv
	$(VENV)/bin/pip install --no-input -q -e '.[examples]' '$(TORCH_PIN)'
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py $(DEMO_ARGS)

# LoRA fine-tuning of a small Hugging Face Llama (PEFT) on 2 CPU ranks; ~1 min.
lora-demo: venv
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/lora_finetune.py

# Compare fsdp_compose with DDP, FSDP2 and FSDP1 (see BENCHMARKS.md); ~10 min.
# BENCH_ARGS=--quick for a ~1 min smoke run, or e.g. BENCH_ARGS="--scenario many-small".
bench: venv
	$(VENV)/bin/pip install --no-input -q -e '.[bench]'
	$(VPY) -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
