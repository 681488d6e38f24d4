"""`python -m psworker`: the same as the `psworker` console script."""

from psworker.cli import main

raise SystemExit(main())
