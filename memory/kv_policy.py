"""KVPolicy: what happens to a preempted job's KV cache (paper section 4.2).

- PROACTIVE (FastServe): offload ahead of need, ranked by Estimated Next
  Scheduled Time, and upload before the job's turn, overlapped with compute
  (memory/proactive.py).
- REACTIVE (baseline): offload only when an allocation fails; upload only
  when the scheduler picks the job, which runs once its copy lands; the
  other jobs go on meanwhile (the copies overlap compute).
- REACTIVE_BLOCKING (the paper's reactive baseline): the same swaps, but no
  iteration starts while a copy is in flight: the batch waits for each swap,
  as with synchronous copies (engine/engine.py, schedule_step).
- RECOMPUTE (baseline, vLLM's default): drop the KV; rebuild it by a prefill
  over prompt + output so far when the job runs again.
"""

from __future__ import annotations

import enum


class KVPolicy(str, enum.Enum):
    PROACTIVE = "proactive"
    REACTIVE = "reactive"
    REACTIVE_BLOCKING = "reactive-blocking"
    RECOMPUTE = "recompute"
