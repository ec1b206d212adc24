"""`python -m fastserve ...`: the `fastserve` command without the console script (fastserve/cli.py)."""

from fastserve.cli import main

raise SystemExit(main())
