"""No-leak soak for prefix caching on two tiers (issue 28): multi-turn conversations with disconnects driven
through the engine, every KV block of both tiers accounted for (KVManager.audit) as it goes and at the end.

    python scripts/prefix_soak.py --requests 10000          # the issue's soak (about 10 minutes on 2 busy cores)
    python scripts/prefix_soak.py --requests 300 --audit-every 1

What runs: the engine in process (the real Engine, scheduler, KVManager and Swapper with its copy threads) on a
small random-weight OPT (tests/conftest.py's SMALL_PRE_LN shape, 256-token context) with a small device KV cache
(--device-blocks blocks of 4 tokens) and a host tier (--host-blocks), prefix caching and its host tier on,
kv-policy proactive. --conversations conversations are open at once; each starts from one of a few shared
system prompts, and each user turn is sent with the whole history (earlier prompts and the engine's answers) as
soon as the last answer is in; a conversation ends after 1-8 turns, or before a turn that would not fit the
context, and a new one takes its place. A --disconnect share of the turns are aborted 0-6 steps after they are
added, wherever they are then (waiting, uploading their prefix from the host, prefilling, decoding, swapped):
engine.abort is what the HTTP server calls when a client disconnects (serving/, AsyncEngine.abort). An aborted
turn is retried once with the same history (a client reconnecting) or ends its conversation.

Checks (exit status 1 if one fails): the engine keeps making progress (some output within 5,000 steps); every
--audit-every steps, KVManager.audit (every block of each tier free,
cached, held by a live job or by a cache copy in flight; reference counts equal the block tables); at the end,
no job holds a block and no reference is left on either tier, and after clear_prefix_cache() every block of both
tiers is free. It also reports how often blocks went to the host and came back, so a run that never used the host
tier shows as such.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BS = 4
NO_PROGRESS_STEPS = 5000  # steps without any output: a livelock (a turn takes a few dozen steps at most)
SMALL = dict(vocab_size=512, max_position_embeddings=256, hidden_size=64, num_hidden_layers=3,
             num_attention_heads=4, ffn_dim=128)


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


def small_model(out: Path) -> Path:
    """The small random-weight OPT the soak runs (tests/conftest.py's small_checkpoint does the same)."""
    from modelmaker.opt_checkpoint import opt_config, write_opt_checkpoint
    from modelmaker.tiny_model import build_tiny_model

    tiny = build_tiny_model(out / "tiny-opt")
    model_dir = out / "small"
    model_dir.mkdir()
    write_opt_checkpoint(model_dir, opt_config(**SMALL), seed=0)
    for f in tiny.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (model_dir / f.name).write_bytes(f.read_bytes())
    return model_dir


def make_engine(model_dir, cfg: SoakConfig):
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine(EngineConfig(
        model=str(model_dir), block_size=BS, seed=0, device="cpu", profile="analytic",
        num_gpu_blocks_override=cfg.device_blocks, num_host_blocks_override=cfg.host_blocks,
        kv_policy="proactive", enable_prefix_caching=True, max_num_seqs=cfg.max_num_seqs, max_model_len=256))


def soak(engine, cfg: SoakConfig) -> dict:
    """Run the soak on `engine`; returns the report (raises AssertionError at the first failed check)."""
    from engine.sampling_params import SamplingParams

    rng = random.Random(cfg.seed)
    kv = engine.kv
    systems = [[rng.randrange(3, 512) for _ in range(n)] for n in (8, 21, 34)]
    ctx = min(engine.max_model_len, cfg.device_blocks * BS)  # a request's whole KV must fit the device too
    convs: dict[int, dict] = {}  # conversation -> {"history": tokens, "turns_left": n, "retry": bool}
    live: dict[str, tuple[int, int | None]] = {}  # request id -> (conversation, step to abort at or None)
    next_conv = sent = finished = aborted = steps = 0

    def open_conversation() -> None:
        nonlocal next_conv
        convs[next_conv] = {"history": list(rng.choice(systems)), "turns_left": rng.randint(1, 8), "retry": False}
        next_conv += 1

    def send(c: int) -> bool:
        nonlocal sent
        conv = convs[c]
        prompt = conv["history"] + [rng.randrange(3, 512) for _ in range(rng.randint(2, 16))]
        max_tokens = rng.randint(1, 10)
        if len(prompt) + max_tokens > ctx:
            return False
        rid = f"c{c}t{sent}"
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        conv["prompt"] = prompt
        live[rid] = (c, steps + rng.randint(0, 6) if rng.random() < cfg.disconnect else None)
        sent += 1
        return True

    for _ in range(cfg.conversations):
        open_conversation()
    idle = list(convs)
    t0 = time.perf_counter()
    last_progress = 0
    while sent < cfg.requests or live:
        assert steps - last_progress < NO_PROGRESS_STEPS, f"no request finished in {NO_PROGRESS_STEPS} steps (livelock)"
        while idle and sent < cfg.requests:  # every idle conversation sends its next turn now
            c = idle.pop()
            if not send(c):  # the next turn would not fit the context: a new conversation instead
                del convs[c]
                open_conversation()
                idle.append(next_conv - 1)
        outs = engine.step()
        steps += 1
        if outs:
            last_progress = steps
        for out in outs:
            if not out.finished or out.request_id not in live:
                continue
            c, _ = live.pop(out.request_id)
            finished += 1
            conv = convs[c]
            conv["history"] = conv["prompt"] + list(out.outputs[0].token_ids)
            conv["turns_left"] -= 1
            conv["retry"] = False
            if conv["turns_left"] <= 0:
                del convs[c]
                open_conversation()
                c = next_conv - 1
            idle.append(c)
        for rid, (c, at) in list(live.items()):
            if at is not None and steps >= at:
                engine.abort(rid)  # a client disconnecting
                del live[rid]
                aborted += 1
                conv = convs[c]
                if conv["retry"]:  # a second disconnect: the user leaves
                    del convs[c]
                    open_conversation()
                    c = next_conv - 1
                else:
                    conv["retry"] = True
                idle.append(c)
        if cfg.audit_every and steps % cfg.audit_every == 0:
            kv.audit()
        if not outs and kv.pending_transfers():
            time.sleep(0.001)
    deadline = time.monotonic() + 30
    while kv.pending_transfers():  # the cache's own copies may outlive the last job
        assert time.monotonic() < deadline, "copies in flight never landed"
        time.sleep(0.001)
        kv.poll()
    elapsed = time.perf_counter() - t0
    assert not engine.has_unfinished()
    end = kv.audit()
    for tier in ("device", "host"):
        assert end[tier]["jobs"] == 0 and end[tier]["refs"] == 0 and end[tier]["copies"] == 0, (tier, end[tier])
    cleared = kv.clear_prefix_cache()
    after = kv.audit()
    for tier, n in (("device", kv.device.num_blocks), ("host", kv.host.num_blocks)):
        assert after[tier]["free"] == n, (tier, after[tier])
    s, dev = kv.stats, kv.device
    return {
        "config": asdict(cfg), "requests_sent": sent, "finished": finished, "aborted": aborted, "steps": steps,
        "seconds": round(elapsed, 1), "at_end": end, "cleared_blocks": cleared, "after_clear": after,
        "hit_rate": dev.num_hits / max(1, dev.num_queries), "host_hit_tokens": s.host_hit_tokens,
        "prefix_uploads": s.num_prefix_uploads, "prefix_prefetches": s.num_prefix_prefetches,
        "cache_blocks_backed_up": s.cache_blocks_backed_up, "cache_evicted_to_host": s.cache_evicted_to_host,
        "cache_evicted_dropped": s.cache_evicted_dropped, "offloads": s.num_offloads, "drops": s.num_drops,
        "blocks_not_copied": s.blocks_not_copied,
    }


def main(argv=None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(d).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    cfg = SoakConfig(**{k: getattr(args, k) for k in asdict(d)})
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = small_model(Path(tmp))
        engine = make_engine(model_dir, cfg)
        try:
            report = soak(engine, cfg)
        except AssertionError as e:
            print(f"FAILED: {e}")
            return 1
        finally:
            engine.shutdown()
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
