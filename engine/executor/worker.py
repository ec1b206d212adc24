"""One worker process of MultiprocExecutor: one GPU (or one CPU process under
gloo), one tensor-parallel shard of one pipeline stage.

    python -m engine.executor.worker        # reads RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
                                            # FASTSERVE_CLUSTER_KEY (hex) from the environment

The controller spawns its node's workers itself; engine/executor/node.py
starts the workers of another node. A worker connects to the controller's
control port (MASTER_PORT + 1), receives its setup, joins the torch.distributed
world (NCCL on CUDA, gloo on CPU) at MASTER_ADDR:MASTER_PORT, loads its shard,
measures its peak memory with a warm-up forward, reports how many KV blocks
fit, allocates what the controller decides, then serves steps until told to
stop (engine/executor/messages.py).

The host tier (the swap space) is allocated when the controller says so and
page-locked in the background (engine/host_tier.py); while that goes on the
main loop wakes every HOST_REPORT_S, between messages, to tell the controller
how many host blocks are locked (HostReady), so the controller learns of them
even while the engine is idle. Only the main thread sends on the connection.

Per step: apply the swap orders on its copy streams (or copy thread), build
the batch from the per-job state it keeps, receive the hidden states from the
previous stage (unless first), run its layers, send the hidden states on
(unless last); the last stage's tensor rank 0 samples and replies. A worker
exits when the controller's connection closes, when its parent dies, or on
any exception (after reporting it): the controller treats that as a fault.
A worker ignores SIGINT (Ctrl-C reaches a terminal's whole process group; the controller stops its workers on
its own SIGINT). A collective that fails because a peer died is one line in the log, a moment later, and only
if the controller has not stopped this worker by then (it names the worker that died).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch

from engine.batch import ModelBatch, SequenceWork
from engine.cuda_graphs import graphs_wanted
from engine.decode_inputs import graph_buckets
from engine.executor import messages as m
from engine.executor.device_identity import describe_cuda_device
from engine.host_copies import HostCopyCounter, count_file
from engine.host_tier import SlowLockForTests
from engine.kv_cache import blocks_that_fit, kv_reserve
from engine.loader import load_model_stage
from engine.model.registry import load_model_config
from engine.model_runner import ModelRunner
from engine.parallel import ParallelLayout, TensorParallelGroup

log = logging.getLogger("fastserve.worker")
PEER_FAILURE_GRACE_S = 1.0  # how long a worker whose collective failed waits for the controller to stop it


def peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another rank went away (gloo's and NCCL's errors)."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(w in text for w in ("gloo", "NCCL", "Connection reset by peer",
                                                                    "Connection closed by peer"))

CLUSTER_KEY_ENV = "FASTSERVE_CLUSTER_KEY"
HOST_REPORT_S = 0.05  # while the host tier is being locked: how often the idle loop looks for progress to report


@dataclass(eq=False)
class _Job:
    prompt_len: int
    tokens: list[int]
    params: object
    generator: torch.Generator | None
    table: list[int]


class Worker:
    def __init__(self, rank: int, local_rank: int, conn: Connection, setup: m.WorkerSetup) -> None:
        self.rank, self.conn, self.setup = rank, conn, setup
        tp, pp = setup.tp_size, setup.pp_size
        self.layout = ParallelLayout(tp, pp, tp_rank=rank % tp, pp_rank=rank // tp)
        if setup.device == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[setup.dtype]
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://{setup.master_addr}:{setup.master_port}", world_size=tp * pp, rank=rank)
        # Every rank creates every tensor-parallel group, in the same order (torch.distributed's rule).
        groups = [torch.distributed.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if tp > 1 else []
        tp_group = TensorParallelGroup(self.layout, groups[self.layout.pp_rank] if groups else None)
        cfg = load_model_config(setup.model_dir)
        model = load_model_stage(setup.model_dir, cfg, tp_group, dtype, self.device, setup.load_format, setup.seed)
        self.runner = ModelRunner(model, self.device, dtype, setup.block_size, setup.seed, setup.attention_backend)
        self.is_sampler = self.layout.is_last_stage and self.layout.tp_rank == 0
        self.jobs: dict[int, _Job] = {}
        self.copies: dict[int, object] = {}  # transfer id -> handle, until done
        self._sends: list = []  # (isend work, tensor) of hidden states on their way to the next stage
        self._host_tier_id = -1  # the controller's id of the host tier attached last
        self._host_reported = 0  # its blocks_ready as last reported
        self._count_file = count_file()  # tests: count each step's host-to-device copies (engine/host_copies.py)

    # -- start-up --------------------------------------------------------------------------------
    def ready_message(self) -> m.Ready:
        s = self.setup
        fit = 0
        if s.measure_kv:
            peak = self.runner.measure_peak_memory(s.max_num_batched_tokens, s.max_model_len)
            backend = self.runner.attention_backend
            graphs = graphs_wanted(s.enforce_eager, self.device, s.tp_size)
            reserve = kv_reserve(  # what this rank allocates after sizing (graphs, NCCL's p2p, logits, gather)
                self.runner.model.cfg, self.layout, self.runner.dtype, block_size=s.block_size,
                max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len,
                max_num_batched_tokens=s.max_num_batched_tokens, attention_backend=backend,
                graph_buckets=graph_buckets(s.max_num_seqs, s.max_model_len, s.block_size, backend) if graphs else None)
            fit = blocks_that_fit(self.runner.kv_block_bytes, self.device, s.gpu_memory_utilization, peak, reserve)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        gpu = describe_cuda_device(self.rank, self.layout.tp_rank, self.layout.pp_rank, self.device)
        return m.Ready(self.rank, fit, self.runner.kv_block_bytes, name, gpu)

    # -- the loop --------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            waiting = True
            if self._host_locking():
                self._report_host()  # here too, so that a stream of steps does not hold the reports back
                waiting = self.conn.poll(0.001 if self.copies else HOST_REPORT_S)
            elif self.copies:
                waiting = self.conn.poll(0.001)
            if not waiting:
                self._report_copies()
                continue
            msg = self.conn.recv()
            if isinstance(msg, m.StepMessage):
                self._step(msg)
            elif isinstance(msg, m.AllocateKV):
                self.runner.allocate_kv_cache(msg.num_blocks)
                s = self.setup
                if self.runner.decode_graphs is None and graphs_wanted(s.enforce_eager, self.device, s.tp_size):
                    self.runner.use_decode_graphs(s.max_num_seqs, s.max_model_len, capture=True)
                    self.runner.capture_decode_graphs()  # before serving: no capture in the middle of traffic
                elif self.runner.decode_graphs is None and s.tp_size > 1:
                    # Eager decode steps (no graphs across ranks): inputs staged in one pinned buffer, one copy
                    self.runner.use_staged_decode_inputs(s.max_num_seqs, s.max_model_len)
            elif isinstance(msg, m.AttachHost):
                # Locked in the background; the loop reports the progress (MultiprocExecutor.host_blocks_ready).
                self.runner.attach_host_tier(msg.num_blocks, test_lock=SlowLockForTests.from_env(self.rank))
                self._host_tier_id = msg.tier_id
                self._report_host(always=True)
            elif isinstance(msg, m.Shutdown):
                return
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")

    def _step(self, msg: m.StepMessage) -> None:
        for h in msg.released:
            self.jobs.pop(h, None)
        for nj in msg.new_jobs:
            gen = torch.Generator().manual_seed(nj.seed) if nj.seed is not None and self.is_sampler else None
            self.jobs[nj.handle] = _Job(nj.prompt_len, list(nj.tokens), nj.params, gen, [])
        for order in msg.transfers:
            self.copies[order.transfer_id] = self.runner.swapper.copy(order.direction, order.pairs)
        if msg.step_id < 0:
            self._report_copies()
            return
        start = time.perf_counter()
        batch = self._batch(msg.jobs, msg.eos_token_ids)
        runner, layout = self.runner, self.layout
        if self._count_file is None:
            inputs = runner.prepare(batch)
        else:
            with HostCopyCounter() as counter:
                inputs = runner.prepare(batch)
            with open(self._count_file, "a") as f:
                f.write(f"{self.rank} {batch.num_tokens} {len(batch.seqs)} {counter.count}\n")
        hidden = None
        if not layout.is_first_stage:
            hidden = torch.empty(inputs.num_tokens, runner.model.cfg.hidden_size, dtype=runner.dtype,
                                 device=self.device)
            torch.distributed.recv(hidden, src=self.rank - layout.tp_size)
        hidden = runner.forward(inputs, hidden)
        if not layout.is_last_stage:
            # Sent without waiting, so this stage goes on with the next step; each tensor stays alive until sent.
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
            self._sends.append((torch.distributed.isend(hidden, dst=self.rank + layout.tp_size), hidden))
        if self.is_sampler:
            results = runner.sample(hidden, inputs, batch)
            done = self._done_copies()
            self.conn.send(m.StepReply.of(self.rank, msg.step_id, results, time.perf_counter() - start, done))
        else:
            self._report_copies()

    def _batch(self, steps: m.StepJobs, eos_token_ids: tuple[int, ...]) -> ModelBatch:
        seqs = []
        plp, no_sample = set(steps.prompt_logprobs), set(steps.no_sample)
        for i, (handle, start, n, new) in enumerate(zip(steps.handles, steps.start_pos, steps.num_tokens,
                                                         steps.new_tokens)):
            job = self.jobs[handle]
            job.tokens += new
            if i in steps.replaced_tables:
                job.table = steps.replaced_tables[i]
            elif i in steps.appended_blocks:
                job.table += steps.appended_blocks[i]
            end = start + n
            history = job.params.uses_history  # penalties read the prompt and the output so far
            seqs.append(SequenceWork(
                job_id=str(handle), token_ids=job.tokens[start:end], start_pos=start,
                block_table=job.table, params=job.params, generator=job.generator,
                num_generated=max(0, end - job.prompt_len), want_prompt_logprobs=i in plp,
                prompt_token_ids=job.tokens[: job.prompt_len] if i in plp or history else [],
                output_token_ids=job.tokens[job.prompt_len:end] if history else [],
                sample=i not in no_sample, prompt_len=job.prompt_len,
            ))
        return ModelBatch(seqs, eos_token_ids)

    def _done_copies(self) -> list[int]:
        done = [tid for tid, h in self.copies.items() if h.done()]
        for tid in done:
            del self.copies[tid]
        return done

    def _host_locking(self) -> bool:
        """Whether the host tier has locked blocks not reported yet, or is still locking."""
        swapper = self.runner.swapper
        if swapper is None or swapper.tier is None:
            return False
        return swapper.tier.pinning or swapper.tier.blocks_ready != self._host_reported

    def _report_host(self, always: bool = False) -> None:
        """Send HostReady when the count of locked host blocks changed since the last report (or always)."""
        ready = self.runner.swapper.tier.blocks_ready
        if always or ready != self._host_reported:
            self._host_reported = ready
            self.conn.send(m.HostReady(self.rank, self._host_tier_id, ready))

    def _report_copies(self) -> None:
        done = self._done_copies()
        if done:
            self.conn.send(m.TransfersDone(self.rank, done))


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the process that spawned it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _watch_controller(conn: Connection, parent_pid: int) -> None:
    """Exit at once when the controller's connection closes or the parent is gone, even while the main thread
    is blocked in a collective whose peer died (it would wait for torch.distributed's long timeout)."""
    fd = conn.fileno()
    sock = socket.socket(fileno=os.dup(fd))
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        readable, _, _ = select.select([sock], [], [], 0.5)
        if readable:
            try:
                peek = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                os._exit(3)
            if not peek:  # EOF: the controller is gone
                os._exit(3)
            time.sleep(0.2)  # a message is waiting for the main thread


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float = 300.0) -> Connection:
    """Connect to the controller, retrying while it is not listening yet (another node may start first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_worker(rank: int, local_rank: int, control_addr: tuple[str, int], authkey: bytes,
               threads: int | None = None, die_with_parent: bool = True) -> None:
    """The worker's whole life; returns (or exits) when it ends. die_with_parent: the spawning thread lives as
    long as its process (the kernel's parent-death signal follows the thread, not the process)."""
    parent = os.getppid()
    if die_with_parent:
        _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides when its workers stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{rank} %(levelname)s %(message)s")
    if threads:
        torch.set_num_threads(threads)
    conn = _connect(control_addr, authkey)
    threading.Thread(target=_watch_controller, args=(conn, parent), daemon=True, name="watch-controller").start()
    conn.send(m.Hello(rank, os.getpid(), socket.gethostname()))
    worker = None
    try:
        setup: m.WorkerSetup = conn.recv()
        worker = Worker(rank, local_rank, conn, setup)
        conn.send(worker.ready_message())
        worker.serve()
    except (EOFError, ConnectionError):
        pass  # the controller is gone
    except BaseException as e:
        if peer_failure(e):  # most likely a peer died: the controller sees it too, and stops this worker
            time.sleep(PEER_FAILURE_GRACE_S)
            log.error("worker %d: a collective failed (%s: %s)", rank, type(e).__name__,
                      str(e).strip().splitlines()[0] if str(e).strip() else "")
        else:
            log.error("worker %d failed:\n%s", rank, traceback.format_exc())
        try:
            conn.send(m.WorkerFailed(rank, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if worker is not None:
            worker.runner.shutdown()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def worker_env(master_addr: str, master_port: int, world_size: int, key_hex: str, local_world: int,
               die_with_parent: bool = True) -> dict[str, str]:
    """The torchrun-style environment of a node's workers (RANK and LOCAL_RANK are added per worker)."""
    env = dict(os.environ, MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(world_size))
    env[CLUSTER_KEY_ENV] = key_hex
    env["FASTSERVE_DIE_WITH_PARENT"] = "1" if die_with_parent else "0"
    if not torch.cuda.is_available():  # CPU workers share the cores
        env.setdefault("FASTSERVE_WORKER_THREADS", str(max(1, (os.cpu_count() or 1) // local_world)))
    return env


def start_worker(env: dict[str, str], rank: int, local_rank: int) -> subprocess.Popen:
    """Start one worker process (`python -m engine.executor.worker`) with its ranks in the environment."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(env, RANK=str(rank), LOCAL_RANK=str(local_rank))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "engine.executor.worker"], env=env, cwd=root)


def main() -> None:
    """Entry point under a torchrun-style environment: MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE and
    FASTSERVE_CLUSTER_KEY (the controller's secret, hex)."""
    env = os.environ
    key = env.get(CLUSTER_KEY_ENV)
    if not key:
        sys.exit(f"{CLUSTER_KEY_ENV} is not set: give every node the controller's cluster key (hex)")
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    threads = int(env["FASTSERVE_WORKER_THREADS"]) if env.get("FASTSERVE_WORKER_THREADS") else None
    run_worker(int(env["RANK"]), int(env["LOCAL_RANK"]), (addr, port + 1), bytes.fromhex(key), threads,
               die_with_parent=env.get("FASTSERVE_DIE_WITH_PARENT", "1") == "1")


if __name__ == "__main__":
    main()
