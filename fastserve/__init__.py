"""FastServe's user-facing command (`fastserve`, fastserve/cli.py) and its benchmark client (fastserve/bench/)."""
