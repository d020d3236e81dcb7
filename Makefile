# The two commands a new user needs: `make demo` (the main job: the quickstart scenario end to
# end) and `make test` (every tier).
.PHONY: bootstrap demo measure test soak lint clean
VENV ?= .venv

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/testbed run quickstart

measure: bootstrap
	$(VENV)/bin/testbed demo

# Every tier runs even when one before it failed (a failure in the host tier hid the other two's
# results); the command fails if any did, naming them.
test: bootstrap
	$(VENV)/bin/ruff check netem testbed tests benchmarks examples scripts
	$(VENV)/bin/lint-imports
	@failed=""; \
	$(VENV)/bin/python -m pytest -m "not netem_kernel and not compose and not gpu" tests \
		|| failed="$$failed host"; \
	$(VENV)/bin/python -m pytest -m compose tests || failed="$$failed compose"; \
	$(VENV)/bin/testbed sandbox pytest -m netem_kernel tests || failed="$$failed guest"; \
	if [ -n "$$failed" ]; then echo "make test: tiers that failed:$$failed"; exit 1; fi

# Every tier several times while a busy loop keeps one core busy; prints failures per test.
# SOAK="--tiers host --runs 2" narrows it (scripts/soak.py --help).
soak: bootstrap
	$(VENV)/bin/python scripts/soak.py $(SOAK)

lint: bootstrap
	$(VENV)/bin/ruff check netem testbed tests benchmarks examples scripts
	$(VENV)/bin/lint-imports

clean: bootstrap
	$(VENV)/bin/testbed clean
