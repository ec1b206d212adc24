"""No leaks with prefix caching on two tiers: multi-turn conversations with disconnects (aborts) driven through
the engine, every block of both tiers audited as it goes; at the end no job holds a block, no reference is left,
and clearing the cache frees every block. The run must have used the host tier (blocks evicted to it and hits
uploaded from it), else it would say nothing about it. `pytest -m slow tests/test_prefix_soak.py` runs 10,000.

What runs: the engine in process (the real Engine, scheduler, KVManager and Swapper with its copy threads) on a
small random-weight OPT (SMALL_PRE_LN, 256-token context) with a small device KV cache (blocks of 4 tokens) and a
host tier, prefix caching and its host tier on, kv-policy proactive. `conversations` conversations are open at
once; each starts from one of a few shared system prompts, and each user turn is sent with the whole history
(earlier prompts and the engine's answers) as soon as the last answer is in; a conversation ends after 1-8
turns, or before a turn that would not fit the context, and a new one takes its place. A `disconnect` share of
the turns are aborted 0-6 steps after they are added, wherever they are then (waiting, uploading their prefix
from the host, prefilling, decoding, swapped): engine.abort is what the HTTP server calls when a client
disconnects. An aborted turn is retried once with the same history (a client reconnecting) or ends its
conversation. The engine must keep making progress (some output within NO_PROGRESS_STEPS steps)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_PRE_LN

BS = 4
NO_PROGRESS_STEPS = 5000  # steps without any output: a livelock (a turn takes a few dozen steps at most)


@dataclass
class SoakConfig:
    requests: int = 300
    conversations: int = 12
    disconnect: float = 0.15
    device_blocks: int = 48
    host_blocks: int = 160
    max_num_seqs: int = 8
    audit_every: int = 1
    seed: int = 0


class Conversations:
    """The open conversations of a soak: each one's history, turns left and whether its last turn was retried, and
    the requests in flight (request id -> (conversation, step to abort at or None))."""

    def __init__(self, engine: Engine, cfg: SoakConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.rng = random.Random(cfg.seed)
        self.systems = [[self.rng.randrange(3, 512) for _ in range(n)] for n in (8, 21, 34)]
        self.ctx = min(engine.max_model_len, cfg.device_blocks * BS)  # a request's whole KV must fit the device too
        self.convs: dict[int, dict] = {}
        self.live: dict[str, tuple[int, int | None]] = {}
        self.next = self.sent = self.finished = self.aborted = 0
        self.idle = [self.open() for _ in range(cfg.conversations)]

    def open(self) -> int:
        c = self.next
        self.convs[c] = {"history": list(self.rng.choice(self.systems)), "turns_left": self.rng.randint(1, 8),
                         "retry": False}
        self.next += 1
        return c

    def reopen(self, c: int) -> int:
        """Conversation c ends; a new one takes its place."""
        del self.convs[c]
        return self.open()

    def send_idle(self, step: int) -> None:
        """Every idle conversation sends its next turn now (one that would not fit the context: a new one)."""
        while self.idle and self.sent < self.cfg.requests:
            c = self.idle.pop()
            conv = self.convs[c]
            prompt = conv["history"] + [self.rng.randrange(3, 512) for _ in range(self.rng.randint(2, 16))]
            max_tokens = self.rng.randint(1, 10)
            if len(prompt) + max_tokens > self.ctx:
                self.idle.append(self.reopen(c))
                continue
            rid = f"c{c}t{self.sent}"
            self.engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            conv["prompt"] = prompt
            abort_at = step + self.rng.randint(0, 6) if self.rng.random() < self.cfg.disconnect else None
            self.live[rid] = (c, abort_at)
            self.sent += 1

    def answered(self, outs) -> None:
        for out in outs:
            if not out.finished or out.request_id not in self.live:
                continue
            c, _ = self.live.pop(out.request_id)
            self.finished += 1
            conv = self.convs[c]
            conv["history"] = conv["prompt"] + list(out.outputs[0].token_ids)
            conv["turns_left"] -= 1
            conv["retry"] = False
            self.idle.append(self.reopen(c) if conv["turns_left"] <= 0 else c)

    def disconnect(self, step: int) -> None:
        for rid, (c, at) in list(self.live.items()):
            if at is not None and step >= at:
                self.engine.abort(rid)  # a client disconnecting
                del self.live[rid]
                self.aborted += 1
                conv = self.convs[c]
                if conv["retry"]:  # a second disconnect: the user leaves
                    c = self.reopen(c)
                else:
                    conv["retry"] = True
                self.idle.append(c)


def soak(engine: Engine, cfg: SoakConfig) -> dict:
    """Run the soak on `engine`, auditing every `audit_every` steps; the report (an AssertionError at the first
    failed check)."""
    kv, talk = engine.kv, Conversations(engine, cfg)
    steps = last_progress = 0
    while talk.sent < cfg.requests or talk.live:
        assert steps - last_progress < NO_PROGRESS_STEPS, f"no request finished in {NO_PROGRESS_STEPS} steps (livelock)"
        talk.send_idle(steps)
        outs = engine.step()
        steps += 1
        last_progress = steps if outs else last_progress
        talk.answered(outs)
        talk.disconnect(steps)
        if cfg.audit_every and steps % cfg.audit_every == 0:
            kv.audit()
        if not outs and kv.pending_transfers():
            time.sleep(0.001)
    deadline = time.monotonic() + 30
    while kv.pending_transfers():  # the cache's own copies may outlive the last job
        assert time.monotonic() < deadline, "copies in flight never landed"
        time.sleep(0.001)
        kv.poll()
    assert not engine.has_unfinished()
    end = kv.audit()
    for tier in ("device", "host"):
        assert end[tier]["jobs"] == 0 and end[tier]["refs"] == 0 and end[tier]["copies"] == 0, (tier, end[tier])
    kv.clear_prefix_cache()
    after = kv.audit()
    for tier, n in (("device", kv.device.num_blocks), ("host", kv.host.num_blocks)):
        assert after[tier]["free"] == n, (tier, after[tier])
    s = kv.stats
    return {"requests_sent": talk.sent, "finished": talk.finished, "aborted": talk.aborted,
            "host_hit_tokens": s.host_hit_tokens, "prefix_uploads": s.num_prefix_uploads,
            "prefix_prefetches": s.num_prefix_prefetches, "cache_evicted_to_host": s.cache_evicted_to_host}


def run(small_checkpoint, cfg: SoakConfig) -> dict:
    engine = Engine(EngineConfig(
        model=str(small_checkpoint(SMALL_PRE_LN)), block_size=BS, seed=0, device="cpu", profile="analytic",
        num_gpu_blocks_override=cfg.device_blocks, num_host_blocks_override=cfg.host_blocks,
        kv_policy="proactive", enable_prefix_caching=True, max_num_seqs=cfg.max_num_seqs, max_model_len=256))
    try:
        return soak(engine, cfg)
    finally:
        engine.shutdown()


def test_a_few_hundred_multi_turn_requests_with_disconnects_leave_every_block_accounted_for(small_checkpoint):
    report = run(small_checkpoint, SoakConfig(requests=300, seed=1))
    assert report["requests_sent"] == 300 and report["finished"] + report["aborted"] == 300
    assert report["aborted"] >= 20
    assert report["cache_evicted_to_host"] > 0 and report["host_hit_tokens"] > 0 and report["prefix_uploads"] > 0
    assert report["prefix_prefetches"] > 0  # waiting turns were uploaded ahead of need


@pytest.mark.slow
def test_ten_thousand_multi_turn_requests_with_disconnects(small_checkpoint):
    report = run(small_checkpoint, SoakConfig(requests=10_000, seed=0, audit_every=10))
    assert report["finished"] + report["aborted"] == 10_000 and report["host_hit_tokens"] > 0
