"""Overload admission's default bound: how many KV blocks the started jobs may hold, device and host together,
before a job with no KV anywhere waits (memory/kv_manager.py, "Overload admission"; the engine sets it where there
is a host tier and no --kv-overcommit)."""

from __future__ import annotations

KV_GROWTH_RESERVE = 8  # the started jobs may hold both tiers less 1/KV_GROWTH_RESERVE of both


def admission_limit(device_blocks: int, host_blocks: int) -> int:
    """The KV blocks the started jobs may hold (device and host) before a job with no KV waits, with a host tier and
    no --kv-overcommit: both tiers less an eighth of both. Past that every eviction drops a context that must be
    recomputed (memory/kv_manager.py, "Overload admission"). The eighth is the room the started jobs grow into as
    they decode: past capacity they are hundreds, most on the host (an eighth of the device alone let prompt-heavy
    work overflow into drops: docs/kv-cache.md, "Admission")."""
    both = device_blocks + host_blocks
    return max(1, both - both // KV_GROWTH_RESERVE)
