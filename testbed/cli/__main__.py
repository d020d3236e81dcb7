"""`python -m testbed.cli`, as the sandbox runs a scenario in a guest."""

from testbed.cli import app

app()
