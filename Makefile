# The two commands a new user needs: `make demo` (the main job: the quickstart scenario end to
# end) and `make test` (every tier).
.PHONY: bootstrap demo measure test lint clean
VENV ?= .venv

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/testbed run quickstart

measure: bootstrap
	$(VENV)/bin/testbed demo

test: bootstrap
	$(VENV)/bin/ruff check netem testbed tests benchmarks
	$(VENV)/bin/python -m pytest -m "not netem_kernel and not compose" tests
	$(VENV)/bin/python -m pytest -m compose tests
	$(VENV)/bin/testbed sandbox pytest -m netem_kernel tests

lint: bootstrap
	$(VENV)/bin/ruff check netem testbed tests benchmarks

clean: bootstrap
	$(VENV)/bin/testbed clean
