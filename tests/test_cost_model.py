"""The cost model prices an iteration as the engine runs it: one forward pass over all its tokens plus each
part's attention (scheduler/cost_model.py). Checked on hand-made profiles whose parts are known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.cost_model import PROFILE_SCHEMA, ProfiledCostModel

REPO = Path(__file__).resolve().parents[1]

W = 0.010  # one pass over the weights (s)
PER_TOKEN = 1e-5  # the per-token work of the forward pass (s)
ATTN_PROMPT = 1e-7  # a prompt's attention: this x prompt_len^2
ATTN_CONTEXT = 2e-7  # a decoding sequence's attention: this x its context


def known_profile(with_forward: bool = True) -> ProfiledCostModel:
    """A profile generated from known parts: F(n) = W + PER_TOKEN n, t_init(p) = F(p) + ATTN_PROMPT p^2,
    t_dec(b, c) = F(b) + ATTN_CONTEXT b c."""
    lens, batches, contexts = [1, 16, 64, 256, 1024, 2048], [1, 8, 64, 256], [1, 128, 1024, 2048]
    forward = lambda n: W + PER_TOKEN * n  # noqa: E731
    data = {
        "schema": PROFILE_SCHEMA, "key": {"model": "known"},
        "prefill": {"prompt_lens": lens, "seconds": [forward(p) + ATTN_PROMPT * p * p for p in lens]},
        "decode": {"batch_sizes": batches, "context_lens": contexts,
                   "seconds": [[forward(b) + ATTN_CONTEXT * b * c for c in contexts] for b in batches]},
    }
    if with_forward:
        tokens = [1, 64, 1024, 8192]
        data["forward"] = {"tokens": tokens, "seconds": [forward(n) for n in tokens]}
    return ProfiledCostModel.from_dict(data)


def truth(prompts: list[int], contexts: list[int]) -> float:
    """One pass over the weights for every token, each prompt's and each decoder's attention."""
    tokens = sum(prompts) + len(contexts)
    return (W + PER_TOKEN * tokens + sum(ATTN_PROMPT * p * p for p in prompts)
            + ATTN_CONTEXT * sum(contexts))


@pytest.mark.parametrize("prompts,contexts", [
    ([16], []), ([], [128] * 8), ([256, 16, 64], []), ([1024, 16], [128] * 64), ([64] * 8, [1024] * 256),
    ([2048], [1] * 8), ([1], [1]),
])
def test_an_iteration_is_one_pass_over_the_weights_plus_each_parts_attention(prompts, contexts):
    cost = known_profile()
    assert cost.batch_cost(prompts, contexts) == pytest.approx(truth(prompts, contexts), rel=1e-9)


def test_prompts_batched_together_share_the_weight_pass():
    """The old rule added t_init per prompt, as if each read the weights alone: eight 64-token prompts cost
    eight passes. Batched they cost one pass and their own attention."""
    cost = known_profile()
    together = cost.batch_cost([64] * 8, [])
    assert together == pytest.approx(truth([64] * 8, []))
    assert together < 0.25 * sum(cost.t_init(64) for _ in range(8))
    assert together >= cost.t_init(64)  # never cheaper than its most expensive part alone


def test_a_part_alone_costs_its_profiled_time():
    cost = known_profile()
    assert cost.batch_cost([300], []) == cost.t_init(300)
    assert cost.batch_cost([], [100, 300]) == cost.t_dec(2, 200)
    assert cost.batch_cost([], []) == 0.0


def test_without_a_forward_table_f_is_the_decode_step_at_the_shortest_context():
    cost = known_profile(with_forward=False)
    for n in (1, 8, 64, 256):
        assert cost.forward(n) == cost.t_dec(n, 1)
    # The shortest context is one token here, so F is nearly exact and so is the iteration.
    assert cost.batch_cost([64] * 8, [128] * 8) == pytest.approx(truth([64] * 8, [128] * 8), rel=1e-3)


def test_the_forward_table_round_trips_and_is_validated():
    cost = known_profile()
    again = ProfiledCostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again == cost and again.forward(100) == cost.forward(100)
    data = cost.to_dict()
    data["forward"]["tokens"] = [64, 1, 1024, 8192]
    with pytest.raises(ValueError, match="forward.tokens must be strictly increasing"):
        ProfiledCostModel.from_dict(data)
    data["forward"] = {"tokens": [1, 2], "seconds": [0.1]}
    with pytest.raises(ValueError, match="forward.tokens and .seconds"):
        ProfiledCostModel.from_dict(data)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "profiles" / "sim").glob("*.json")))
def test_simulator_profiles_price_batched_prompts_below_their_sum(name):
    """The roofline profiles carry a forward table; batching prompts costs less than running them alone,
    and no less than the largest alone."""
    cost = ProfiledCostModel.from_json(REPO / "profiles" / "sim" / name)
    assert cost.forward_tokens and cost.forward_tokens[-1] >= 8192
    for prompts in ([100] * 5, [512, 64, 16], [1024, 1024]):
        both = cost.batch_cost(prompts, [500] * 32)
        alone = sum(cost.t_init(p) for p in prompts) + cost.t_dec(32, 500)
        assert max(cost.t_init(max(prompts)), cost.t_dec(32, 500)) <= both < alone
