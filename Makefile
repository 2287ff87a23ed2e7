# The two set-up commands of the README: `make up` (main job) and `make test` (the tests).
.PHONY: up test bootstrap test-fast bench

bootstrap:
	bash scripts/bootstrap.sh

up: bootstrap
	.venv/bin/rlstream up $(ARGS)

test: bootstrap
	.venv/bin/python -m pytest tests --durations=15 $(PYTEST_ARGS)

test-fast: bootstrap
	.venv/bin/python -m pytest tests -m "unit or integration" $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/python bench/streams_throughput.py
	.venv/bin/python bench/learner_step.py
