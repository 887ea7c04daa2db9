PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-redis bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flightcache demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The same suite against another server binary (Debian's redis-server by default).
REDIS_SERVER ?= $(shell command -v redis-server)
test-redis: $(STAMP)
	FLIGHTCACHE_SERVER_BIN=$(REDIS_SERVER) $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
