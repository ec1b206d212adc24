"""Where one job's KV lives (Residency) and the KV manager's record of it (JobKV): the types that
memory/kv_manager.py keeps and memory/proactive.py reads, in a module of their own so neither imports the
other's internals."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from memory.transfers import TransferHandle


class Residency(str, enum.Enum):
    NONE = "none"  # no KV anywhere (new, or dropped: recompute)
    DEVICE = "device"
    HOST = "host"
    OFFLOADING = "offloading"  # device -> host copy in flight; both tiers held
    UPLOADING = "uploading"  # host -> device copy in flight; both tiers held


@dataclass(eq=False)
class JobKV:
    job: object  # scheduler.Job (read: job_id, num_computed; written: ready, num_computed on drop)
    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    residency: Residency = Residency.NONE
    order: int = 0  # when the KV manager made the entry (its offload candidates come in this order)
    transfer: TransferHandle | None = None
    transfer_tick: int = -1  # tick the last transfer started (no ping-pong within a tick)
    transfer_started: float = 0.0
    predicted_wait: float | None = None  # ENST when an upload started, for ENST accuracy
    upload_time: float | None = None
    freed: bool = False  # finished or aborted while a copy was in flight
    cancel_upload: bool = False  # evicted while uploading: the device blocks free when the copy lands
    offload_tick: int | None = None  # tick of the last offload, until the job is wanted back (thrash count)
    pending_blocks: int = 0  # device blocks that free when the transfer in flight completes
    # Prefix caching (memory/prefix_cache.py): the names of the job's full blocks computed so far, how many of
    # `device`'s leading blocks are registered (or found taken), and the table that count is for.
    hashes: list = field(default_factory=list)
    num_registered: int = 0
    registered_table: list | None = None
    cached_tokens: int | None = None  # tokens its first lookup found cached (None: never looked up)
    # Computed tokens from which allocate's fast path calls the naming (KVManager._register_full): at most where
    # a prompt block fills past num_registered, 0 when `device` may be a new table, never (inf) with caching off
    # or once the prompt's full blocks are named (generated blocks are named when the job leaves the device).
    name_at: float = float("inf")
    # Two tiers (memory/kv_manager.py): the job has not run yet and its `host` blocks are a cached prefix found on
    # the host tier (references on the host cache's blocks), parked there for an upload ahead of need.
    host_prefix: bool = False
