"""The load generator (`fastserve bench serve`, loadgen.py) and the workloads that it, the simulator and the
benchmarks replay: dataset readers (workload.py), arrival processes (arrivals.py), the HTTP client (client.py),
metrics (metrics.py), plots (plot.py) and the token counter for text datasets (tokens.py). No torch import."""
