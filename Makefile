# moemesh: `make up` starts the whole mesh on the embedded default, `make test` runs the tests.
# Both create .venv and install what they need on first use (scripts/bootstrap.sh).
VENV := .venv/bin
PYTEST_ARGS ?=
# pytest-xdist processes for `make test`; a test file's tests stay in one (--dist loadfile)
TEST_WORKERS ?= 2

.PHONY: setup up demo test lint bench clean

setup:
	@scripts/bootstrap.sh

up: setup
	$(VENV)/moemesh up $(ARGS)

demo: setup  # train the demo model once (minutes on a CPU); `make up` serves it from then on
	$(VENV)/moemesh demo-model

# A Triton cache of the run's own, cold each time: a warm ~/.triton/cache must never hide a failure.
# A worker process that dies fails the run at once, naming the test it ran (xdist's replacement worker can
# wait forever under --dist loadfile: pytest-xdist#784).
test: setup
	@cache=$$(mktemp -d); TRITON_CACHE_DIR=$$cache $(VENV)/python -m pytest -q -p no:cacheprovider --durations=30 \
	  -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0 $(PYTEST_ARGS); \
	rc=$$?; rm -rf $$cache; exit $$rc

lint: setup
	$(VENV)/ruff check proto libs services tests bench
	$(VENV)/mypy

bench: setup
	$(VENV)/python -m bench.engine_cpu

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
