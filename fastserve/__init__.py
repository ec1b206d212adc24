"""FastServe's user-facing command (`fastserve`, fastserve/cli.py): one module per command (simulate.py,
compare.py, replay.py, profile.py, make_model.py; serve is server.py) and the benchmark client (fastserve/bench/)."""
