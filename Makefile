# Set-up and entry points. `make demo` and `make test` each create .venv if
# it is missing and install the project into it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch: kept as it is when the venv already has one. Otherwise the CPU build
# is installed where no NVIDIA GPU is visible, the default (CUDA) build where
# one is. TORCH_INDEX_URL points pip at another index for torch alone, e.g.
# https://download.pytorch.org/whl/cpu on a CPU machine without a local wheel.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
# `make test` runs the suite in this many processes (pytest-xdist; 1: one process, in collection order).
# Three by default, on 2 cores too: many tests wait on processes, sockets and clusters rather than compute
# (docs/history/performance-log.md, "The test suite's time": 490.5 s in three, 599.7 s in two, same tree).
TEST_JOBS ?= 3

.PHONY: venv bytecode tools demo test test-cpu test-fast stress fuzz partition compose-check lint typecheck proto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Installs go through uv where pip can install it into the venv (the same packages as pip resolves, in about
# 30 s against 83 s on this machine class, bytecode compiled: docs/performance.md), with pip's own settings
# handed over (deploy/uvflags.py: uv reads no pip.conf); through pip where uv cannot be had.
# recbole: its wheel holds MovieLens-100K (tests/test_movielens.py, `shardps demo --example movielens`);
# --no-deps, as its own dependencies pin an old Ray.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	@set -e; \
	everything() { \
		if $(BIN)/python -c "import torch" 2>/dev/null; then \
			echo "torch already installed: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
		elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
			echo "NVIDIA GPU found: installing the default (CUDA) torch build"; \
			$$1 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "torch==$(TORCH_VERSION)" || return 1; \
		else \
			echo "no GPU: installing the CPU build of torch $(TORCH_VERSION)"; \
			$$1 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "torch==$(TORCH_VERSION)+cpu" \
			  || $$1 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "torch==$(TORCH_VERSION)" || return 1; \
		fi; \
		$$1 -e ".[dev]" && $$1 --no-deps recbole==1.2.1; \
	}; \
	if $(BIN)/pip install -q uv >/dev/null 2>&1 && [ -x $(BIN)/uv ]; then \
		uv="$(BIN)/uv pip install --python $(BIN)/python --native-tls --compile-bytecode --index-strategy unsafe-best-match $$($(BIN)/python deploy/uvflags.py)"; \
		echo "installing with uv: $$uv"; \
		everything "$$uv" || { echo "uv failed: installing with pip"; everything "$(BIN)/pip install"; }; \
	else \
		echo "uv could not be installed: installing with pip"; everything "$(BIN)/pip install"; \
	fi
	@touch $@

venv: $(VENV)/.installed

# The project's own bytecode, compiled once before its processes start: where PYTHONDONTWRITEBYTECODE is set,
# every process (servers, workers, Ray actors) would otherwise compile each module it imports from source,
# about 0.25 CPU-s a process that imports the server, worker and Ray stage modules (docs/history/performance-log.md).
# Python still reads __pycache__ with the variable set; it only stops writing it.
PY_DIRS := shardps server worker protos deploy examples benchmarks tests
bytecode: venv
	@$(BIN)/python -m compileall -q -j 0 $(PY_DIRS) >/dev/null

demo: venv bytecode
	$(BIN)/shardps demo

# Debian tools some tests use: a real Prometheus (scrape and PromQL tests),
# docker-compose (validates deploy/docker-compose.yml) and etcd. Installed with apt
# when missing and we are root; otherwise those tests say why they skip.
# Each as package:command. etcd-server: the coordinator of `--coordinator etcd://...` (server/coordinator.py),
# started by the tests on free ports.
DEBIAN_TOOLS := prometheus:prometheus docker-compose:docker-compose etcd-server:etcd

tools:
	@missing=""; \
	for t in $(DEBIAN_TOOLS); do command -v $${t#*:} >/dev/null 2>&1 || missing="$$missing $${t%%:*}"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian packages:$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else \
			echo "warning:$$missing not installed (needs root and apt-get): their tests will be skipped"; \
		fi; \
	fi

# The whole suite (its 30 slowest tests listed at the end: where the wall time goes), in TEST_JOBS
# processes (with more than one, the Ray tests run in two groups, each in one of them with its own Ray
# cluster: tests/conftest.py), and beside its start lint and types (ruff, mypy --strict: the package ships
# py.typed; mypy holds one core for about 20 s), their output printed after it; either failing fails
# `make test`. Tests that need Ray start their own clusters (ray start on free ports, token auth) and stop
# exactly those; whatever a killed run left behind is stopped after the suite, whatever its outcome.
test: venv tools bytecode
	@mkdir -p build; $(MAKE) --no-print-directory lint > build/lint.log 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest --durations=30 $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadgroup) \
		$(PYTEST_ARGS); rc=$$?; $(BIN)/python -m shardps.deploy.ray.stop_stale; \
	wait $$lint; lrc=$$?; echo "--- make lint (ruff, mypy) ---"; cat build/lint.log; \
	if [ $$lrc -ne 0 ]; then echo "make lint failed ($$lrc)"; exit $$lrc; fi; exit $$rc

# Where the suite's CPU goes: the whole suite in one process, each test's CPU seconds (the whole machine's:
# its servers, workers and Ray actors too) counted and the costliest listed at the end (tests/cpu.py); one
# JSON line per test in build/cpu-per-test.jsonl. On a quiet machine: it counts everything that runs.
test-cpu: venv tools bytecode
	@mkdir -p build
	$(BIN)/python -m pytest -q -p tests.cpu -p no:xdist --cpu-out build/cpu-per-test.jsonl $(PYTEST_ARGS); \
		rc=$$?; $(BIN)/python -m shardps.deploy.ray.stop_stale; exit $$rc

# The edit-test loop: no servers on sockets, no processes (well under a minute).
test-fast: venv
	$(BIN)/python -m pytest -m "not cluster" -q $(PYTEST_ARGS)

# The fault tests (kills, restarts, failovers, leases) REPEAT times beside LOAD busy processes.
REPEAT ?= 20
LOAD ?= 2
stress: venv tools
	$(BIN)/python -m tests.stress --repeat $(REPEAT) --load $(LOAD)

# A long fuzz campaign: every job shape the fuzzer supports, CASES cases each, with a fresh random seed
# (printed first; replay a failure with SEED=N and, for one shape, benchmarks/fuzz.py --seed N --shards ...).
CASES ?= 10000
SEED ?=
fuzz: venv
	$(BIN)/python benchmarks/fuzz.py --all-shapes --cases $(CASES) $(if $(SEED),--seed $(SEED))

# The partition harness (deploy/partitions.py): each of its seven nemeses RUNS times against a job under
# --coordinator on a simulated cluster, every run checked (nothing acknowledged lost or applied twice, one server
# a version, the job goes on); the table at the end is docs/operations.md's. Needs root; etcd from `make tools`.
RUNS ?= 20
partition: venv tools
	$(BIN)/python -m shardps.deploy.partitions --runs $(RUNS) $(PARTITION_ARGS)

# deploy/docker-compose.yml brought up for real with Docker on this machine (deploy/composecheck.py): servers
# healthy, workers trained, checkpoints in the volume, Prometheus scraping, a second run, a failover; then
# everything it made taken down. Needs root; installs Debian's docker.io and docker-compose when missing. Not
# part of `make test`. COMPOSE_CHECK_ARGS=--remove-images also removes the images it built.
compose-check: venv
	$(BIN)/python -m shardps.deploy.composecheck $(COMPOSE_CHECK_ARGS)

lint: venv typecheck
	$(BIN)/ruff check .

# mypy on the package as it installs (shardps.server = server/, ...): a tree of links in
# build/typecheck; strictness per package in pyproject.toml.
typecheck: venv
	@rm -rf build/typecheck && mkdir -p build/typecheck/shardps
	@for f in shardps/*.py shardps/py.typed shardps/testing; do ln -s "$(CURDIR)/$$f" build/typecheck/shardps/; done
	@for d in server worker protos deploy examples; do ln -s "$(CURDIR)/$$d" build/typecheck/shardps/$$d; done
	cd build/typecheck && $(abspath $(BIN))/mypy --config-file "$(CURDIR)/pyproject.toml" \
		--cache-dir "$(CURDIR)/.mypy_cache" -p shardps

# Regenerate the committed gRPC/protobuf stubs (tests/test_proto_stubs.py
# fails when they are out of date).
proto: venv
	$(BIN)/python -m shardps.codegen

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
