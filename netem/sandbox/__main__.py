"""`python -m netem.sandbox`: see `netem.sandbox.cli`."""

from netem.sandbox.cli import main

raise SystemExit(main())
