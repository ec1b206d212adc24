"""MultiprocExecutor: tensor + pipeline parallelism over one worker process
per GPU (engine/executor/worker.py), driven by the controller (this process:
HTTP, engine loop, scheduler, the one KVManager), which does no GPU work.

Layout: world = tp x pp ranks; rank r is tensor rank r % tp of stage r // tp.
Block ids are the same on every rank (each holds its slice of every block),
so the controller's KVManager owns all block state.

Transport: one authenticated socket per worker (multiprocessing.connection
over TCP, so workers on other nodes connect the same way). A step is pickled
once and written to every rank; only the sampling rank (last stage, tensor
rank 0) replies with tokens; every rank reports the copies it completed. Why
not a shared-memory ring: one socket write per rank costs tens of
microseconds for the few KB a step holds (scripts/benchmarks/parallel.py), sockets
reach other nodes unchanged, and a closed socket is how a dead worker shows.

Swaps: the KVManager's copies become TransferOrders carried with the next
step (or sent alone when no step follows); every rank applies them on its copy
streams before that step's compute; a copy is done when every rank reported
it. Pipeline parallelism: up to pp steps are in flight (max_in_flight); each
stage runs them in order, so stage 0 works on step k + 1 while stage 1 works
on step k.

Host tier: each worker allocates its own and page-locks it in the background
(engine/host_tier.py), reporting how many leading blocks it has locked
(HostReady: once when attached, then as the count grows); host_blocks_ready()
is the minimum over ranks, since a host block may be handed out only when
every rank has locked its slice. Start-up does not wait for the locking.

Faults: a reader thread waits on every socket and every local process; a
worker that dies, closes its socket or reports an exception marks the
executor dead within a poll interval (0.2 s): pending steps fail with
ExecutorDeadError, failure listeners run (the engine ends every request), the
remaining workers are killed. Workers die with their parent (prctl) and exit
when the controller's socket closes, so no process outlives the controller.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import queue
import secrets
import socket
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path

import torch

from engine.batch import BatchResult, ModelBatch
from engine.config import EngineConfig
from engine.executor import messages as m
from engine.executor.base import Executor, ExecutorDeadError
from engine.executor.device_identity import WorkerDevice
from engine.executor.local import resolve_device, resolve_dtype
from engine.executor.worker import start_worker, worker_env
from engine.model.registry import ModelConfig
from engine.parallel import ParallelLayout
from fastserve_kernels.attention_backend import resolve_attention_backend
from memory.transfers import Direction

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint takes minutes
PLACEHOLDER_TOKEN = 1  # stands for tokens the controller never sent (OPT's pad id)
POLL_S = 0.2  # the reader's wake-up interval: how soon a dead process without a socket event is noticed


def check_layout(cfg: ModelConfig, tp: int, pp: int, device: torch.device, nnodes: int) -> None:
    """One-line errors for layouts that cannot work, before any process starts."""
    world = tp * pp
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if world // nnodes > visible:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} needs {world // nnodes} GPUs "
                             f"per node, but {visible} are visible")
    for size, what in ((cfg.num_attention_heads, "num_attention_heads"), (cfg.ffn_dim, "ffn_dim")):
        if size % tp:
            raise ValueError(f"the model's {what} ({size}) is not divisible by tensor_parallel_size {tp}")
    ParallelLayout(tp_size=tp).kv_heads(cfg.num_key_value_heads)  # KV heads split, or replicated: else an error
    if cfg.num_hidden_layers < pp:
        raise ValueError(f"the model has {cfg.num_hidden_layers} layers, fewer than pipeline_parallel_size {pp}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port with the next one free too (the rendezvous at p, the control port at p + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port < 65535 and port_free(host, port + 1):
            return port
    raise RuntimeError("no free port pair found")


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


@dataclass
class _JobMirror:
    """What the workers know of a job: its message handle, tokens they hold, the block table they hold."""

    handle: int
    known_len: int
    table: list[int]


class _RemoteCopy:
    """A TransferHandle: done when every rank has reported the copy complete."""

    def __init__(self, executor: MultiprocExecutor, transfer_id: int) -> None:
        self._ex, self.transfer_id = executor, transfer_id

    def done(self) -> bool:
        self._ex._flush()
        if self._ex._error is not None:
            return True  # nothing will move again; the engine is failing every request
        return self.transfer_id not in self._ex._copy_reports


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig, max_model_len: int) -> None:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world, self.tp, self.pp = tp * pp, tp, pp
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_layout(model_cfg, tp, pp, self.device, config.nnodes)
        # Resolved here, so a backend that cannot run fails before any worker starts.
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.max_in_flight = pp
        self._error: str | None = None
        self._failure_listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # sends, and the state they read
        self._pending: deque[tuple[int, Future]] = deque()  # steps in flight, in order
        self._step_ids = itertools.count()
        self._handles = itertools.count()
        self._transfer_ids = itertools.count()
        self._jobs: dict[str, _JobMirror] = {}
        self._released: list[int] = []
        self._orders: list[m.TransferOrder] = []
        self._copy_reports: dict[int, set[int]] = {}  # copies in flight: transfer id -> ranks that completed it
        self._host_tier_ids = itertools.count()
        self._host_tier_id = -1  # the host tier attached last
        self._host_ready: dict[int, int] = {}  # rank -> host blocks it reported locked, for that tier
        self._host_reported = threading.Condition()  # notified by the reader on each HostReady
        self._procs: dict[int, subprocess.Popen] = {}
        self._conns: dict[int, Connection] = {}
        self._closed = False
        self.last_message_bytes = 0  # size of the last message sent (scripts/benchmarks/parallel.py)
        self._start(config, model_dir, max_model_len)
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="fastserve-workers")
        self._reader.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (ex := ref()) is not None and ex.shutdown())

    # -- start-up ----------------------------------------------------------------------------------
    def _start(self, config: EngineConfig, model_dir: Path, max_model_len: int) -> None:
        addr = config.master_addr
        port = config.master_port if config.master_port is not None else free_port(addr)
        for p in (port, port + 1):
            if not port_free(addr, p):
                raise ValueError(f"the rendezvous port {p} on {addr} is already in use; pass another --master-port "
                                 f"(ports {port} and {port + 1} are used)")
        key_hex = os.environ.get("FASTSERVE_CLUSTER_KEY")
        authkey = bytes.fromhex(key_hex) if key_hex else secrets.token_bytes(32)
        if config.nnodes > 1 and not key_hex:
            raise ValueError("with --nnodes > 1 set FASTSERVE_CLUSTER_KEY (hex) to the same secret on every node")
        self.master_addr, self.master_port = addr, port
        listener = Listener((addr, port + 1), authkey=authkey, backlog=self.world)
        accepted: queue.Queue = queue.Queue()
        threading.Thread(target=_accept_all, args=(listener, self.world, accepted), daemon=True).start()
        local = self.world // config.nnodes
        env = worker_env(addr, port, self.world, authkey.hex(), local,
                         die_with_parent=threading.current_thread() is threading.main_thread())
        for rank in range(local):  # the first node's ranks; node.py starts the others' with the same environment
            self._procs[rank] = start_worker(env, rank, rank)
        try:
            self._handshake(config, model_dir, max_model_len, accepted)
        except BaseException:
            self._kill_all()
            raise
        finally:
            listener.close()

    def _handshake(self, config: EngineConfig, model_dir: Path, max_model_len: int, accepted: queue.Queue) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self._conns) < self.world:
            try:
                conn = accepted.get(timeout=0.2)
            except queue.Empty:
                self._check_started(deadline, "connect")
                continue
            hello = conn.recv()
            self._conns[hello.rank] = conn
        setup = m.WorkerSetup(
            model_dir=str(model_dir), tp_size=self.tp, pp_size=self.pp,
            dtype=str(self.dtype).removeprefix("torch."), load_format=config.load_format, device=self.device.type,
            block_size=self.block_size,
            seed=config.seed, master_addr=self.master_addr, master_port=self.master_port,
            measure_kv=config.num_gpu_blocks_override is None,
            max_num_batched_tokens=config.sizing_batched_tokens, max_model_len=max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization, max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager, attention_backend=self.attention_backend)
        for conn in self._conns.values():
            conn.send(setup)
        ready: dict[int, m.Ready] = {}
        while len(ready) < self.world:
            for conn in wait(list(self._conns.values()), timeout=0.2):
                msg = conn.recv()
                if isinstance(msg, m.WorkerFailed):
                    raise RuntimeError(f"worker rank {msg.rank} failed to start: {msg.message}")
                ready[msg.rank] = msg
            self._check_started(deadline, "load the model")
        self.kv_block_bytes = max(r.kv_block_bytes for r in ready.values())
        self._worker_devices = [ready[r].gpu for r in sorted(ready) if ready[r].gpu is not None]
        self.num_device_blocks = config.num_gpu_blocks_override or min(r.blocks_that_fit for r in ready.values())
        self._broadcast(m.AllocateKV(self.num_device_blocks))
        log.info("%d workers (tp %d x pp %d) ready on %s; %d KV blocks per rank", self.world, self.tp, self.pp,
                 ", ".join(sorted({r.device_name for r in ready.values()})), self.num_device_blocks)

    def _check_started(self, deadline: float, doing: str) -> None:
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"worker rank {rank} exited with code {proc.returncode} during start-up "
                                   f"(see its log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not {doing} within {STARTUP_TIMEOUT_S:.0f} s")

    # -- the Executor interface ---------------------------------------------------------------------
    def worker_devices(self) -> list[WorkerDevice]:
        """Each CUDA rank's GPU as the rank reported it in its Ready message ([] for CPU workers)."""
        return list(self._worker_devices)

    def attach_host_tier(self, num_host_blocks: int) -> MultiprocExecutor:
        """Every worker allocates its host tier and starts locking it; returns once each has answered (the
        allocation itself is quick: the locking goes on in the background, host_blocks_ready says how far)."""
        with self._host_reported:
            self._host_tier_id = tier_id = next(self._host_tier_ids)
            self._host_ready = {}
        self._broadcast(m.AttachHost(num_host_blocks, tier_id))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self._host_reported:
            while len(self._host_ready) < self.world:
                if self._error is not None:
                    raise ExecutorDeadError(self._error)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not allocate their host tier within {STARTUP_TIMEOUT_S:.0f} s")
                self._host_reported.wait(POLL_S)
        return self

    def copy(self, direction: Direction, pairs: list[tuple[int, int]]) -> _RemoteCopy:
        """The TransferBackend verb: the order travels with the next step (or alone, when a handle is polled)."""
        with self._lock:
            tid = next(self._transfer_ids)
            self._orders.append(m.TransferOrder(tid, direction, list(pairs)))
            self._copy_reports[tid] = set()
        return _RemoteCopy(self, tid)

    def host_blocks_ready(self) -> int:
        """The TransferBackend verb: the leading host blocks every rank has reported locked (all of them at once
        on the CPU), the minimum over ranks."""
        ready = self._host_ready
        return min(ready.get(rank, 0) for rank in range(self.world))

    def host_blocks_locked_by_rank(self) -> dict[int, int]:
        """Each rank's last report of its host tier: how many leading blocks it has locked."""
        return dict(self._host_ready)

    def release(self, job_ids: list[str]) -> None:
        with self._lock:
            for jid in job_ids:
                mirror = self._jobs.pop(jid, None)
                if mirror is not None:
                    self._released.append(mirror.handle)

    def submit(self, batch: ModelBatch) -> Future[BatchResult]:
        future: Future[BatchResult] = Future()
        with self._lock:
            if self._error is not None:
                raise ExecutorDeadError(self._error)
            step_id = next(self._step_ids)
            msg = self._step_message(step_id, batch)
            self._pending.append((step_id, future))
            self._send_locked(msg)
        return future

    @property
    def error(self) -> str | None:
        return self._error

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        self._failure_listeners.append(listener)

    def worker_pids(self) -> dict[int, int]:
        """Local workers' process ids by rank."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._error is None:  # healthy workers finish what they are doing and exit; after a fault, no waiting
            try:
                self._broadcast(m.Shutdown())
            except (OSError, ExecutorDeadError):
                pass
            deadline = time.monotonic() + 5.0
            for proc in self._procs.values():
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._kill_all()
        for conn in self._conns.values():
            conn.close()
        if self._procs:
            log.info("workers stopped: %s", ", ".join(f"rank {rank} (pid {proc.pid}) exit code {proc.returncode}"
                                                      for rank, proc in self._procs.items()))

    # -- messages -----------------------------------------------------------------------------------
    def _step_message(self, step_id: int, batch: ModelBatch) -> m.StepMessage:
        msg = self._take_deltas(step_id)
        msg.eos_token_ids = batch.eos_token_ids
        jobs = msg.jobs
        for i, seq in enumerate(batch.seqs):
            end = seq.start_pos + len(seq.token_ids)
            mirror = self._jobs.get(seq.job_id)
            if mirror is None:
                # A job's first step starts at 0, except the job profiler's synthetic decode steps: their earlier
                # tokens are (said to be) in the KV cache already, and nothing reads them but penalties.
                tokens = [PLACEHOLDER_TOKEN] * seq.start_pos + list(seq.token_ids)
                if seq.start_pos == 0 and len(seq.prompt_token_ids) > end:  # a first chunk: the whole prompt, which
                    tokens = list(seq.prompt_token_ids)  # prompt logprobs and penalties read
                prompt_len = seq.prompt_len if seq.prompt_len is not None else end - seq.num_generated
                mirror = self._jobs[seq.job_id] = _JobMirror(next(self._handles), len(tokens), [])
                msg.new_jobs.append(m.NewJob(mirror.handle, prompt_len, tokens, seq.params, seq.seed))
                new_tokens: list[int] = []
            else:
                new_tokens = seq.token_ids[mirror.known_len - seq.start_pos:] if mirror.known_len < end else []
                mirror.known_len = max(mirror.known_len, end)
            table, known = seq.block_table, mirror.table
            if len(table) != len(known) or table != known:
                if table[: len(known)] == known:
                    jobs.appended_blocks[i] = table[len(known):]
                else:
                    jobs.replaced_tables[i] = list(table)
                mirror.table = list(table)
            jobs.handles.append(mirror.handle)
            jobs.start_pos.append(seq.start_pos)
            jobs.num_tokens.append(len(seq.token_ids))
            jobs.new_tokens.append(new_tokens)
            if seq.want_prompt_logprobs:
                jobs.prompt_logprobs.append(i)
            if not seq.sample:
                jobs.no_sample.append(i)
        return msg

    def _take_deltas(self, step_id: int) -> m.StepMessage:
        msg = m.StepMessage(step_id, transfers=self._orders, released=self._released)
        self._orders, self._released = [], []
        return msg

    def _flush(self) -> None:
        """Send swap orders (and releases) that no step has carried yet."""
        if not self._orders or self._error is not None:
            return
        with self._lock:
            if self._orders:
                self._send_locked(self._take_deltas(-1))

    def _broadcast(self, msg) -> None:
        with self._lock:
            self._send_locked(msg)

    def _send_locked(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.last_message_bytes = len(data)
        for rank, conn in self._conns.items():
            try:
                conn.send_bytes(data)
            except OSError as e:
                self._fail(f"worker rank {rank} is unreachable ({type(e).__name__})")
                raise ExecutorDeadError(self._error) from None

    # -- the reader thread ----------------------------------------------------------------------------
    def _read_loop(self) -> None:
        rank_of = {conn: rank for rank, conn in self._conns.items()}
        while not self._closed and self._error is None:
            for rank, proc in self._procs.items():
                if proc.poll() is not None and not self._closed:
                    self._fail(f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.returncode})")
                    return
            for ready in wait(list(rank_of), timeout=POLL_S):
                rank = rank_of[ready]
                try:
                    msg = ready.recv()
                except (EOFError, OSError):
                    if not self._closed:
                        proc = self._procs.get(rank)
                        code = proc.wait(1.0) if proc is not None else None
                        how = f"pid {proc.pid}, exit code {code}" if proc is not None else "on another node"
                        self._fail(f"worker rank {rank} died ({how})")
                    return
                try:
                    self._handle(msg)
                except Exception as e:  # a reply out of order or of an unknown kind: nothing can be trusted
                    log.exception("bad message from worker rank %d", rank)
                    self._fail(f"worker rank {rank} sent a bad message ({type(e).__name__}: {e})")
                    return

    def _handle(self, msg) -> None:
        if isinstance(msg, m.StepReply):
            step_id, future = self._pending.popleft()
            if step_id != msg.step_id:
                raise RuntimeError(f"reply for step {msg.step_id}, expected {step_id}")
            self._copies_reported(msg.rank, msg.transfers_done)
            future.set_result(BatchResult(msg.results(), msg.execute_s))
        elif isinstance(msg, m.TransfersDone):
            self._copies_reported(msg.rank, msg.transfer_ids)
        elif isinstance(msg, m.HostReady):
            with self._host_reported:
                if msg.tier_id == self._host_tier_id:  # else about a tier replaced since
                    self._host_ready[msg.rank] = msg.blocks_ready
                    self._host_reported.notify_all()
        elif isinstance(msg, m.WorkerFailed):
            self._fail(f"worker rank {msg.rank} failed: {msg.message}")
        else:
            raise TypeError(f"unexpected {type(msg).__name__}")

    def _copies_reported(self, rank: int, transfer_ids: list[int]) -> None:
        for tid in transfer_ids:
            ranks = self._copy_reports.get(tid)
            if ranks is None:
                continue
            ranks.add(rank)
            if len(ranks) == self.world:
                del self._copy_reports[tid]

    def _fail(self, message: str) -> None:
        if self._error is not None:
            return
        self._error = message
        log.error("%s; failing every request", message)
        while self._pending:
            _, future = self._pending.popleft()
            future.set_exception(ExecutorDeadError(message))
        self._kill_all()
        for listener in self._failure_listeners:
            try:
                listener(message)
            except Exception:
                log.exception("failure listener raised")

    def _kill_all(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not exit after SIGKILL", proc.pid)


def _accept_all(listener: Listener, n: int, out: queue.Queue) -> None:
    for _ in range(n):
        try:
            out.put(listener.accept())
        except OSError:
            return  # the listener was closed (start-up failed or finished)
