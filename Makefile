PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-redis bench soak model lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flightcache demo

# The model checker's tests (pure Python, no server: about 75 s of one core) run beside the
# rest, whose tests mostly wait on servers and processes: the suite takes the rest's time,
# not the sum. Both must pass; the model's log is printed after the rest's.
test: $(STAMP)
	@$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_model.py > .model-tests.log 2>&1 & \
	model=$$!; \
	$(BIN)/python -m pytest -q --ignore=tests/test_model.py; rest=$$?; \
	wait $$model; modelrc=$$?; \
	echo "-- tests/test_model.py, run beside the rest:"; \
	if [ $$modelrc -eq 0 ]; then tail -n 1 .model-tests.log; else cat .model-tests.log; fi; \
	test $$rest -eq 0 && test $$modelrc -eq 0

# The same suite against another server binary (Debian's redis-server by default), but the
# model checker's tests (tests/test_model.py: pure Python, no server; `make test` runs them).
REDIS_SERVER ?= $(shell command -v redis-server)
test-redis: $(STAMP)
	FLIGHTCACHE_SERVER_BIN=$(REDIS_SERVER) $(BIN)/python -m pytest -q --ignore=tests/test_model.py

bench: $(STAMP)
	$(BIN)/python -m bench

# The fault soak (docs/faults.md): about 2.5 minutes against one server; pass options with
# SOAK_ARGS, e.g. make soak SOAK_ARGS="--cluster --seed 7 --seconds 60".
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/python -m soak $(SOAK_ARGS)

# The protocol's model check (model/, docs/protocol.md "The model check"): every scope,
# the larger ones too, with states explored, time and each invariant's result.
model: $(STAMP)
	$(BIN)/python -m model --large

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
