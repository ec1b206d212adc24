"""The simulator's multi-turn chat replay (engine/simulation.py, run_conversations): each turn's prompt is
the conversation so far, sent after the previous answer plus a think time; with prefix caching the simulated KV
manager (the real one) finds the history cached and the cost model charges only the uncached tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.simulation import run_conversations, simulated_engine

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "sim" / "opt-13b-a100-40gb-x1.json"  # length-dependent prefill costs
GPT2_BPE = REPO / "tests" / "data" / "gpt2-bpe"
BS = 16


@pytest.fixture(scope="module")
def model(flat_sim_model) -> Path:
    return flat_sim_model[0]  # an OPT-13B config-only directory


def engine(model: Path, caching: bool, **kw):
    return simulated_engine(model, PROFILE, num_device_blocks=kw.pop("num_device_blocks", 4000),
                            num_host_blocks=2000, enable_prefix_caching=caching, **kw)


def by_conversation(result) -> dict[int, list]:
    out: dict[int, list] = {}
    for t in result.turns:
        out.setdefault(t.conversation, []).append(t)
    return {c: sorted(ts, key=lambda t: t.number) for c, ts in out.items()}


def test_each_turn_sends_the_history_after_the_answer_plus_think_time_and_finds_it_cached(model):
    convs = [[(40, 20), (30, 25), (50, 10)], [(70, 33), (5, 8)], [(17, 1), (16, 16), (1, 40), (90, 2)]]
    result = run_conversations(engine(model, True), convs, [0.0, 0.4, 0.9], think_time_s=2.0,
                               think_time_distribution="constant", seed=3)
    assert result.ended == {"completed": 3, "context": 0}
    turns = by_conversation(result)
    assert [len(turns[c]) for c in range(3)] == [3, 2, 4]
    for c, ts in turns.items():
        assert ts[0].cached_tokens == 0 and ts[0].prompt_len == 1 + convs[c][0][0]
        for prev, turn in zip(ts, ts[1:]):
            p, o = prev.output, turn.output
            history = list(p.prompt_token_ids) + list(p.outputs[0].token_ids)
            assert list(o.prompt_token_ids[:len(history)]) == history  # the history, token for token
            assert turn.prompt_len == len(history) + convs[c][turn.number - 1][0]
            assert len(o.outputs[0].token_ids) == convs[c][turn.number - 1][1]
            assert o.metrics.arrival_time == pytest.approx(p.metrics.finished_time + 2.0)
            # Every full block of what the previous turn computed (all but its last sampled token) is a hit.
            assert turn.cached_tokens == (len(history) - 1) // BS * BS
    s = result.summary()
    assert s["turns"] == 9 and s["prompt_tokens"] == sum(t.prompt_len for t in result.turns)
    assert s["hit_rate"] == pytest.approx(s["cached_tokens"] / s["prompt_tokens"]) and s["hit_rate"] > 0.4
    # Conversations never share a block: their first user turns differ (ids drawn per conversation).
    firsts = [tuple(turns[c][0].output.prompt_token_ids[:BS]) for c in range(3)]
    assert len(set(firsts)) == 3


def test_cost_model_charges_only_the_uncached_tokens(model):
    """A lone follow-up turn over a 640-token history: its first token takes the profile's price of the uncached
    rest as a chunk over the cached prefix with caching on, and t_init of the whole prompt with it off."""
    convs = [[(600, 40), (20, 5)]]
    ttft, cost, hits = {}, {}, {}
    for caching in (True, False):
        eng = engine(model, caching)
        result = run_conversations(eng, convs, [0.0], think_time_s=1.0, think_time_distribution="constant")
        second = by_conversation(result)[0][1]
        ttft[caching], cost[caching] = second.output.metrics.ttft_s, eng.cost_model
        prompt, hits[caching] = second.prompt_len, second.cached_tokens
    hit = hits[True]
    assert hit == (1 + 600 + 40 - 1) // BS * BS and hits[False] == 0
    assert ttft[True] == pytest.approx(cost[True].batch_cost((), (), ((hit, prompt - hit),)), rel=1e-6)
    assert ttft[False] == pytest.approx(cost[False].t_init(prompt), rel=1e-6)
    assert ttft[True] < ttft[False] / 3


def test_a_conversation_ends_before_a_turn_that_does_not_fit_the_context(model):
    convs = [[(100, 50), (100, 50), (1, 1)], [(10, 10), (10, 10)]]
    result = run_conversations(engine(model, True, max_model_len=256), convs, [0.0, 0.0], think_time_s=0.0)
    assert result.ended == {"completed": 1, "context": 1}
    assert [len(ts) for _, ts in sorted(by_conversation(result).items())] == [1, 2]


def test_exponential_think_times_are_seeded(model):
    convs = [[(20, 4)] * 4 for _ in range(3)]
    gaps = []
    for seed in (7, 7, 8):
        result = run_conversations(engine(model, False), convs, [0.0, 0.1, 0.2], think_time_s=5.0, seed=seed)
        gaps.append([round(b.output.metrics.arrival_time - a.output.metrics.finished_time, 9)
                     for ts in by_conversation(result).values() for a, b in zip(ts, ts[1:])])
    assert gaps[0] == gaps[1] != gaps[2] and all(g > 0 for g in gaps[0]) and len(set(gaps[0])) == len(gaps[0])
    with pytest.raises(ValueError, match="think_time_distribution"):
        run_conversations(engine(model, False), convs, [0.0] * 3, think_time_distribution="normal")


def _jobs_to_park_by_scan(tier) -> list:
    """HostPrefixTier.jobs_to_park as it was before its first-block index: a look at every waiting job, in order."""
    from memory.residency import Residency

    if not (tier._recheck and tier.waiting):
        return []
    tier._recheck = False
    bs, dev, host, found = tier.block_size, tier.device, tier.host, []
    for jid, e in list(tier.waiting.items()):
        if e.residency is not Residency.NONE or e.device or e.host or e.transfer is not None:
            del tier.waiting[jid]
            continue
        max_blocks = (e.job.context_len - 1) // bs
        if not e.hashes or host.block_of(e.hashes[0]) is None:
            continue
        hosted = host.lookup(e.hashes, max_blocks)
        if len(hosted) > len(dev.lookup(e.hashes, max_blocks)):
            del tier.waiting[jid]
            found.append((e, hosted))
    return found


def test_parking_waiting_jobs_found_by_their_first_block_changes_no_decision(model, monkeypatch):
    """The proactive planner parks the jobs waiting to start whose prefix the host caches (jobs_to_park), found
    as candidates by their first blocks' names (HostPrefixTier._candidates) instead of a look at each: 40 chats
    of 4 turns on a 60-block device (histories evicted to the host and prefetched back) give the same turns, to the
    digit, and the same KV counters as with the scan of every waiting job, and jobs were parked (and the index
    pruned) that way."""
    from memory.host_prefix_tier import HostPrefixTier

    rng = random.Random(1)
    convs = [[(rng.randrange(20, 150), rng.randrange(10, 80)) for _ in range(4)] for _ in range(40)]

    def run() -> tuple:
        eng = simulated_engine(model, PROFILE, num_device_blocks=60, num_host_blocks=3000, max_num_seqs=16)
        result = run_conversations(eng, convs, [0.1 * i for i in range(40)], think_time_s=0.5, seed=2)
        turns = [(t.conversation, t.number, t.cached_tokens, t.output.metrics.first_token_time,
                  t.output.metrics.finished_time, t.output.metrics.swap_wait_s) for t in result.turns]
        return turns, vars(eng.kv.stats) | {"enst_samples": list(eng.kv.stats.enst_samples)}

    pruned = []
    add = HostPrefixTier.add_waiting

    def adding(tier, jid, e, recheck=False):
        before = len(tier._heads)
        add(tier, jid, e, recheck)
        pruned.append(len(tier._heads) < before)

    monkeypatch.setattr(HostPrefixTier, "add_waiting", adding)
    fast = run()
    assert fast[1]["num_prefix_prefetches"] > 20 and any(pruned), "too few parked, or never pruned: shows little"
    monkeypatch.setattr(HostPrefixTier, "jobs_to_park", _jobs_to_park_by_scan)
    assert run() == fast


@pytest.fixture
def chats(tmp_path) -> Path:
    """A ShareGPT file of 12 conversations of 2-4 turns each."""
    words = "the cache keeps keys and values of every past token so that decode reads them".split()
    text = lambda n: " ".join(words[j % len(words)] for j in range(n))  # noqa: E731
    records = [{"id": str(i), "conversations": [
        {"from": "human" if k % 2 == 0 else "gpt", "value": text(20 + 13 * ((i + k) % 5))}
        for k in range(2 * (2 + i % 3))]} for i in range(12)]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(records))
    return path


def test_simulate_cli_multi_turn_with_and_without_caching(chats, tmp_path, monkeypatch, capsys):
    from fastserve import make_model, simulate

    monkeypatch.setattr(make_model, "MODELS_DIR", tmp_path)  # the shape's config-only directory goes under tmp_path
    runs = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = tmp_path / f"{flag}.json"
        rc = simulate.main(["--model", "opt-13b", "--profile", str(PROFILE), "--dataset-name", "sharegpt",
                            "--dataset-path", str(chats), "--gpt2-bpe", str(GPT2_BPE), "--num-prompts", "12",
                            "--request-rate", "2", "--multi-turn", "--think-time", "1", flag, "--json", str(out)])
        assert rc == 0, capsys.readouterr()
        runs[flag] = json.loads(out.read_text())
    on, off = runs["--enable-prefix-caching"], runs["--no-enable-prefix-caching"]
    assert on["turns"] == off["turns"] == on["requests"] == 36 and on["conversations"] == 12
    assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
    assert on["hit_rate"] > 0.5 and on["mean_ttft_s"] < off["mean_ttft_s"]
    assert on["prefix_caching"] is True and off["prefix_caching"] is False
    # Conversations opened at an Azure trace's times (scaled to 2/s) rather than Poisson: the same turns.
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i * i / 10:010.7f},100,20\n" for i in range(12)))
    out = tmp_path / "trace.json"
    rc = simulate.main(["--model", "opt-13b", "--profile", str(PROFILE), "--dataset-name", "sharegpt",
                        "--dataset-path", str(chats), "--gpt2-bpe", str(GPT2_BPE), "--num-prompts", "12",
                        "--request-rate", "2", "--multi-turn", "--think-time", "1", "--conversation-trace", str(trace),
                        "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    timed = json.loads(out.read_text())
    assert timed["turns"] == 36 and timed["prompt_tokens"] == on["prompt_tokens"]
    assert timed["mean_ttft_s"] != on["mean_ttft_s"]  # other arrival times (a burst early on), another schedule
    capsys.readouterr()
    for args, words in ((["--dataset-name", "sharegpt", "--dataset-path", str(chats), "--gpt2-bpe", str(GPT2_BPE)],
                         "--multi-turn needs --request-rate"),
                        (["--dataset-name", "synthetic", "--request-rate", "1"], "replays ShareGPT conversations"),
                        (["--no-multi-turn", "--dataset-name", "lengths", "--conversation-trace", str(trace)],
                         "--conversation-trace goes with --multi-turn")):
        assert simulate.main(["--model", "opt-13b", "--profile", str(PROFILE), "--multi-turn", *args]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
