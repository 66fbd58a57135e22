# make serve: fresh clone -> .venv -> install -> default model -> Pagoda on a local Ray cluster
#             (gRPC :9000, OpenAI HTTP :8000; prints "pagoda ready ..."; Ctrl-C stops it and Ray)
# make test:  fresh clone -> .venv -> install -> default model -> the whole test suite
# make test-fast: the tests that need no Ray cluster and no served model (the inner loop)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Bytecode is written by the first process that imports a module, for every process after it (Ray
# starts many): where PYTHONDONTWRITEBYTECODE is set, each would compile each module it imports
# again. Written on first import rather than compiled at install: `make test` imports 5.4K of the
# virtualenv's 18.6K modules, and compiling them all cost the install 60 CPU-s (docs/benchmarks-log.md, "A Zen 1 host")
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install model serve demo test test-fast bench clean

# Where pip finds wheels besides its index (on CPU hosts, the local CPU torch wheel): uv looks there too
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# The constraint keeps the local CPU torch wheel; on GPU machines run: pip install -e '.[test]'
	# DS_BUILD_OPS=0: deepspeed compiles the one op Pagoda uses (CPU shared-memory all-reduce) on first use
	# uv installs the same packages as pip in less time (docs/benchmarks.md, "The test suite"); pip
	# does it wherever uv cannot be had or fails
	( $(BIN)/pip install -q uv && DS_BUILD_OPS=0 $(BIN)/uv pip install -q --python $(BIN)/python \
	    -c constraints.txt $(foreach links,$(FIND_LINKS),--find-links $(links)) -e '.[test]' ) || \
	( $(BIN)/pip install -q --upgrade pip && DS_BUILD_OPS=0 PIP_CONSTRAINT=constraints.txt $(BIN)/pip install -q -e '.[test]' )
	# Pagoda's CPU kernels (model/csrc), built for this CPU; without a compiler torch's paths run
	$(BIN)/python -m model.cpu_ops || echo "Pagoda's CPU kernels did not build: the model runs on torch's paths"
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/pagoda model fetch

serve: model
	$(BIN)/pagoda serve --config serve_config.yaml

demo: model
	$(BIN)/pagoda generate --offline --prompts-file examples/demo_prompts.jsonl --max-tokens 64 --temperature 0

# Pytest workers (xdist): two keep 2 cores busy; a third ran this 24 GB host out of memory (each
# worker holds its own models and servers). The groups run in tests/conftest.py's order, longest first.
TEST_WORKERS ?= 2

test: model
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30 tests

test-fast: model
	PAGODA_TEST_FAST=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=10 -m "not ray" tests

bench: model
	$(BIN)/python -m benchmarks.offline_throughput
	$(BIN)/python -m benchmarks.offline_throughput --natural-stop --max-tokens 256
	$(BIN)/python -m benchmarks.perplexity
	$(BIN)/python -m benchmarks.serving_latency
	$(BIN)/python -m benchmarks.serving_sweep
	$(BIN)/python -m benchmarks.allreduce
	$(BIN)/python -m benchmarks.tp_step_time
	$(BIN)/python -m benchmarks.kv_transfer
	$(BIN)/python -m benchmarks.disaggregation
	$(BIN)/python -m benchmarks.kv_tiers
	$(BIN)/python -m benchmarks.kv_page_codec
	$(BIN)/python -m benchmarks.kv_restart
	$(BIN)/python -m benchmarks.kv_restart --chat --out benchmarks/results/kv_restart_chat.json
	$(BIN)/python -m benchmarks.kv_prefetch
	$(BIN)/python -m benchmarks.kv_write_through
	$(BIN)/python -m benchmarks.ingress_load

clean:
	rm -rf $(VENV)
