"""`python -m agent` is `pitstop`."""

from agent.cli import main

raise SystemExit(main())
