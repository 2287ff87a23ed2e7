# The two set-up commands of the README: `make up` (main job) and `make test` (the tests).
.PHONY: up test bootstrap test-fast bench

# What tests keep for a person to look at (the console's screenshot: tests/integration/test_console_browser.py)
export RLSTREAM_ARTIFACTS_DIR ?= $(CURDIR)/test-artifacts

bootstrap:
	bash scripts/bootstrap.sh

up: bootstrap
	.venv/bin/rlstream up $(ARGS)

# Unit tier first (seconds; a broken unit stops the run early), then every other tier on two pytest-xdist workers
# (tests that share a vLLM server or an expensive fixture stay on one worker: tests/conftest.py, --dist loadgroup).
test: bootstrap
	.venv/bin/python -m pytest tests -m unit $(PYTEST_ARGS)
	.venv/bin/python -m pytest tests -m "not unit" -n 2 --dist loadgroup --durations=15 $(PYTEST_ARGS)

test-fast: bootstrap
	.venv/bin/python -m pytest tests -m "unit or integration" $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/python bench/codec_speed.py
	.venv/bin/python bench/streams_throughput.py
	.venv/bin/python bench/streams_recovery.py
	.venv/bin/python bench/streams_tick.py
	.venv/bin/python bench/learner_step.py
