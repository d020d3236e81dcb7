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

# Every tier runs even when another failed; the command fails if any did, naming them. The
# tiers run side by side: guest; compose then netns; unit once compose has ended
# (scripts/tiers.py --help).
test: bootstrap
	$(VENV)/bin/ruff check netem testbed tests benchmarks examples scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python scripts/tiers.py

# Every tier several times while a busy loop keeps one core busy; prints failures per test.
# SOAK="--tiers unit,netns --runs 2" narrows it (scripts/soak.py --help).
soak: bootstrap
	$(VENV)/bin/python scripts/soak.py $(SOAK)

lint: bootstrap
	$(VENV)/bin/ruff check netem testbed tests benchmarks examples scripts
	$(VENV)/bin/lint-imports

clean: bootstrap
	$(VENV)/bin/testbed clean
