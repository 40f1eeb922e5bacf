# `make test` and `make demo` bootstrap .venv on a fresh machine.
# torch is installed first and pinned, so pip never resolves an unpinned torch (a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test test-fast lint demo demo-lora clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check hf_hybrid_ep scripts tests benchmarks examples

test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests

# Everything but the cases marked slow (a quicker loop while developing; CI runs `make test`).
test-fast: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m "not slow" tests

# The embedded demo through the real launcher: 2 CPU processes (gloo). `--cpu --num_processes N`
# would silently start one process; ACCELERATE_USE_CPU=1 with --multi_gpu starts N on the CPU.
demo: $(STAMP)
	ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch --multi_gpu --num_processes 2 \
		--num_machines 1 --mixed_precision no --dynamo_backend no scripts/train.py

# LoRA on the demo's checkpoint (run `make demo` first): each of 2 CPU processes reads the dense weights and its
# experts, trains adapters on attention and on its experts, and checkpoints only the adapters (PEFT's files).
demo-lora: $(STAMP)
	test -d runs/demo/checkpoint-30 || $(MAKE) demo
	ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch --multi_gpu --num_processes 2 \
		--num_machines 1 --mixed_precision no --dynamo_backend no scripts/train.py \
		--model_name_or_path runs/demo/checkpoint-30 --output_dir runs/demo-lora --lora_r 8 --lora_alpha 16 \
		--max_steps 30 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --learning_rate 3e-3 \
		--warmup_steps 3 --logging_steps 5 --save_steps 30 --max_grad_norm 1.0 --report_to none --block_size 64

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
