"""Start the workers of one more node of a multi-node deployment.

On the first node the server (the controller) starts its own node's workers:

    FASTSERVE_CLUSTER_KEY=$KEY python server.py --model /models/opt-175b --tensor-parallel-size 8 \\
        --pipeline-parallel-size 2 --nnodes 2 --master-addr 10.0.0.1 --master-port 29500

On each other node, with the same model directory at the same path:

    FASTSERVE_CLUSTER_KEY=$KEY python -m engine.executor.node --nnodes 2 --node-rank 1 \\
        --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8

It sets each worker's torchrun-style environment (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK = node_rank x nproc_per_node + LOCAL_RANK, LOCAL_RANK) and
waits; the workers connect to the controller, which sends them everything
else. When any worker exits, the rest are stopped and this exits too (with
the first non-zero code), so a node never keeps a half-dead world.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from engine.executor.worker import CLUSTER_KEY_ENV, start_worker, worker_env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.executor.node", description=__doc__.split("\n")[0])
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True, help="this node's index, 1 .. nnodes-1")
    p.add_argument("--nproc-per-node", type=int, required=True, help="workers (GPUs) on this node")
    p.add_argument("--master-addr", required=True, help="the controller's address (its --master-addr)")
    p.add_argument("--master-port", type=int, required=True, help="the controller's --master-port")
    args = p.parse_args(argv)
    key = os.environ.get(CLUSTER_KEY_ENV)
    if not key:
        p.error(f"set {CLUSTER_KEY_ENV} to the controller's cluster key (hex)")
    if not 1 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank must be in [1, {args.nnodes - 1}] (node 0 is the controller's)")
    world = args.nnodes * args.nproc_per_node
    env = worker_env(args.master_addr, args.master_port, world, key, args.nproc_per_node, die_with_parent=True)
    first = args.node_rank * args.nproc_per_node
    procs = [start_worker(env, first + i, i) for i in range(args.nproc_per_node)]

    def stop(*_):
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while all(proc.poll() is None for proc in procs):
        time.sleep(0.2)
    code = next((proc.returncode for proc in procs if proc.returncode), 0)
    stop()
    for proc in procs:
        proc.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
