# Two commands on a fresh machine:  `make run` (set up, then serve a model on CPU)
# and `make test` (set up, then the whole test suite). Everything they need is installed here.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
MODEL  ?= squeezenet1_0
PORT   ?= 8000

.PHONY: run test setup redis-server chromium clean

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

test: $(STAMP) redis-server chromium
	$(BIN)/pytest -q

# Serves MODEL on CPU at http://127.0.0.1:8000 with the embedded plan store (no Redis): the
# first start profiles and plans the model (a minute or so), later starts read the table.
run: $(STAMP)
	$(BIN)/vbs serve --model $(MODEL) --host 127.0.0.1 --port $(PORT)

clean:
	rm -rf $(VENV) .pytest_cache profiles
