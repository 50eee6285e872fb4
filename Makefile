# Two commands on a fresh machine:  `make run` (set up, then serve a model on CPU)
# and `make test` (set up, then the test suite but its slow cases, the service and store tests
# against the lowest allowed releases and the GPU run's cheap steps rehearsed on the CPU).
# Everything they need is installed here. `make test-full` adds the slow cases and every step of
# the rehearsal; `make gpu` is the GPU run itself (docs/gpu.md).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
MODEL  ?= squeezenet1_0
PORT   ?= 8000

# The lowest releases pyproject.toml allows of redis-py, fastapi, starlette, pydantic(-settings),
# uvicorn, grpcio and protobuf (.ci/lowest.py reads the floors), in a second venv whose .pth adds
# the main venv's packages after its own: everything else (torch included) comes from the main venv.
# The tests run there are those that reach these libraries (the store, the HTTP and gRPC edges,
# settings, the fast path); the memory, many-models, lean-worker, first-start, residency and
# precision tests, which reach only our own code above them, run once, in the main venv.
LOWEST  ?= .venv-lowest
LOWEST_STAMP = $(LOWEST)/.installed
LOWEST_TESTS = tests/planner/test_store_contract.py tests/planner/test_store_errors.py \
               tests/planner/test_corrupt_data.py tests/service tests/loadgen \
               $(addprefix --deselect tests/service/,test_shutdown.py test_memory_limit.py \
                 test_many_models.py test_lean.py test_memory.py test_first_start.py \
                 test_lean_default.py test_residency.py test_precision_served.py)

# The GPU run (bench/gpu/, docs/gpu.md): DEVICE=cuda on the GPU machine, whose own Python gets
# the carried wheels (.gpu-wheels/cp312, `make gpu-wheels` here); DEVICE=cpu QUICK=1 rehearses
# every step on the CPU in a fresh venv (.venv-gpu) with this machine's wheels. STEP=all or a
# comma list of tests, profile, graphs, bench, energy, serve, summary (summary alone installs nothing).
# Results: out/gpu/ (and the device tool's $OUT).
DEVICE ?= cuda
QUICK  ?=
STEP   ?= all
GPU_DEADLINE_S ?= 540
GPU_PY_VERSION ?= 3.12
HERE_PY_VERSION = $$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')

.PHONY: run test test-full test-compute test-service test-edges test-lowest gpu-rehearsal setup \
        redis-server chromium clean gpu gpu-wheels

# The suite in two halves. What computes (models profiled, planned and run) runs first, in two
# pytest-xdist workers whose OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE): with
# libgomp's default, each worker's threads spin on the core the other needs, and two workers
# took twice as long as one after the other; with PASSIVE they take about 0.75x. No test
# asserts a timing, so the policy changes no verdict (servers and benchmarks keep torch's
# default: docs/operations.md). What mostly waits (servers, sockets, a browser, cgroups: the
# service, the load generator, the page, the deployment) runs after it, in two processes,
# beside the lowest releases' run and the GPU rehearsal's short form (`make -j4`). A new
# folder of tests is in the first half unless it is named here.
# `make test` leaves out the tests marked slow (the largest models' cases: C3D's 16 frames of
# 112x112) and runs the rehearsal's cheap steps; `make test-full` runs everything.
# (the service's two slowest files, its shutdown and its memory limit, run with the edges: the
# two processes then take about as long as each other)
SERVICE_SLOW  = tests/service/test_shutdown.py tests/service/test_memory_limit.py
EDGE_TESTS    = tests/loadgen tests/ui tests/deploy $(SERVICE_SLOW)
WAITING_TESTS = tests/service tests/loadgen tests/ui tests/deploy
MARK         ?= not slow
REHEARSE     ?= smoke,tests,graphs,energy
PASSIVE       = OMP_WAIT_POLICY=PASSIVE
MARKS         = $(if $(MARK),-m "$(MARK)")
PYTEST        = $(PASSIVE) $(BIN)/pytest -q $(MARKS)

# setup.py and the .proto: the build compiles the gRPC protocol's modules from them
$(STAMP): pyproject.toml setup.py service/oip/grpc_predict_v2.proto
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Tests start their own redis-server on a free port; this only makes sure the binary exists.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }

# The page's browser tests drive Debian's chromium through Playwright (its own browser
# download is not used).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; }

$(LOWEST_STAMP): pyproject.toml .ci/lowest.py $(STAMP)
	rm -rf $(LOWEST)
	$(BIN)/python -m venv $(LOWEST)
	$(LOWEST)/bin/pip install --quiet --disable-pip-version-check --no-compile $$($(BIN)/python .ci/lowest.py)
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(LOWEST)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-main-venv.pth"
	touch $@

# The service and store tests against the lowest allowed releases (a minute or so).
test-lowest: $(LOWEST_STAMP) redis-server
	$(LOWEST)/bin/python -c "import redis, fastapi, starlette, pydantic, uvicorn, grpc, google.protobuf; \
	  print('lowest:', 'redis', redis.__version__, 'fastapi', fastapi.__version__, 'starlette', \
	  starlette.__version__, 'pydantic', pydantic.VERSION, 'uvicorn', uvicorn.__version__, \
	  'grpcio', grpc.__version__, 'protobuf', google.protobuf.__version__)"
	$(PASSIVE) $(LOWEST)/bin/python -m pytest -q -p no:cacheprovider $(MARKS) $(LOWEST_TESTS)

test: $(STAMP) redis-server chromium
	$(MAKE) --no-print-directory test-compute
	$(MAKE) --no-print-directory -j4 --output-sync=target test-service test-edges test-lowest \
	  gpu-rehearsal STEP=$(REHEARSE)

# Everything: the slow cases too, and every step of the GPU rehearsal.
test-full:
	$(MAKE) --no-print-directory test MARK= REHEARSE=all

test-compute: $(STAMP)
	$(PYTEST) -n 2 $(addprefix --ignore=,$(WAITING_TESTS))

test-service: $(STAMP) redis-server
	$(PYTEST) -p no:cacheprovider tests/service $(addprefix --ignore=,$(SERVICE_SLOW))

test-edges: $(STAMP) redis-server chromium
	$(PYTEST) -p no:cacheprovider $(EDGE_TESTS)

gpu-rehearsal: $(STAMP)
	$(MAKE) --no-print-directory gpu DEVICE=cpu QUICK=1

# The wheels the GPU machine's image lacks, pinned (bench/gpu/wheels.txt), for its Python 3.12:
# carry .gpu-wheels/cp312 with every device call. GPU_PY_VERSION=3.11 fetches this machine's.
gpu-wheels:
	$(PYTHON) bench/gpu/wheels.py --python $(GPU_PY_VERSION)

# The rehearsal (DEVICE=cpu) needs .venv (its stand-in for the GPU image) and this machine's wheels.
gpu: $(if $(filter cpu,$(DEVICE)),$(STAMP))
	@if [ "$(DEVICE)" = cpu ] && [ "$(STEP)" != summary ]; then \
	  $(PYTHON) bench/gpu/wheels.py --python $(HERE_PY_VERSION); fi
	$(PYTHON) bench/gpu/launch.py --device $(DEVICE) $(if $(QUICK),--quick) --step $(STEP) \
	  --deadline-s $(GPU_DEADLINE_S)

# `docker compose up`, really (tests/deploy/test_compose_stack.py; docs/operations.md, "Docker
# compose"): installs Debian's Docker Engine and debootstrap, starts a private dockerd unless one
# runs (its files under COMPOSE_STATE), builds the images as compose.offline.yaml says (no image
# registry is reachable here), runs the stack with a password, talks to it, takes it down.
# Root; 10-20 minutes; about 20 GB under COMPOSE_STATE. From a clean state: rm -rf out/compose.
COMPOSE_STATE ?= out/compose
.PHONY: compose-test docker-engine

docker-engine:
	@command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || { \
	  echo "installing docker.io and debootstrap"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap) >/dev/null; }

compose-test: $(STAMP) docker-engine
	VBS_COMPOSE_TEST=1 VBS_COMPOSE_STATE=$(abspath $(COMPOSE_STATE)) \
	  $(BIN)/pytest -q -s -p no:cacheprovider -m compose tests/deploy/test_compose_stack.py

# Serves MODEL on CPU at http://127.0.0.1:8000 with the embedded plan store (no Redis). The
# first start serves at once from an interim table (the whole model in ONNX Runtime, measured
# in seconds) while `vbs plan` profiles and plans the model beside it (a few minutes on 2
# cores), and swaps the planned table in when it is ready; later starts read the table.
# FIRST_START=wait plans first, serving nothing until then.
FIRST_START ?= interim
run: $(STAMP)
	$(BIN)/vbs serve --model $(MODEL) --host 127.0.0.1 --port $(PORT) --first-start $(FIRST_START)

clean:
	rm -rf $(VENV) $(LOWEST) .venv-gpu .pytest_cache profiles
