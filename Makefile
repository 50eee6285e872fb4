# Two commands on a fresh machine:  `make run` (set up, then serve a model on CPU)
# and `make test` (set up, then the whole test suite, then the service and store tests against
# the lowest allowed releases). Everything they need is installed here.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
MODEL  ?= squeezenet1_0
PORT   ?= 8000

# The lowest releases pyproject.toml allows of redis-py, fastapi, starlette, pydantic(-settings)
# and uvicorn (.ci/lowest.py reads the floors), in a second venv whose .pth adds the main venv's
# packages after its own: everything else (torch included) comes from the main venv.
LOWEST  ?= .venv-lowest
LOWEST_STAMP = $(LOWEST)/.installed
LOWEST_TESTS = tests/planner/test_store_contract.py tests/planner/test_store_errors.py \
               tests/planner/test_corrupt_data.py tests/service \
               --deselect tests/service/test_shutdown.py

.PHONY: run test test-lowest setup redis-server chromium clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
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
	$(LOWEST)/bin/pip install --quiet --disable-pip-version-check $$($(BIN)/python .ci/lowest.py)
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(LOWEST)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-main-venv.pth"
	touch $@

# The service and store tests against the lowest allowed releases (a minute or so).
test-lowest: $(LOWEST_STAMP) redis-server
	$(LOWEST)/bin/python -c "import redis, fastapi, starlette, pydantic, uvicorn; print('lowest:', \
	  'redis', redis.__version__, 'fastapi', fastapi.__version__, 'starlette', starlette.__version__, \
	  'pydantic', pydantic.VERSION, 'uvicorn', uvicorn.__version__)"
	$(LOWEST)/bin/python -m pytest -q -p no:cacheprovider $(LOWEST_TESTS)

test: $(STAMP) redis-server chromium
	$(BIN)/pytest -q
	$(MAKE) --no-print-directory test-lowest

# Serves MODEL on CPU at http://127.0.0.1:8000 with the embedded plan store (no Redis): the
# first start profiles and plans the model (a minute or so), later starts read the table.
run: $(STAMP)
	$(BIN)/vbs serve --model $(MODEL) --host 127.0.0.1 --port $(PORT)

clean:
	rm -rf $(VENV) $(LOWEST) .pytest_cache profiles
