import dataclasses
import random
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
import torch

from trainer.data import TrainingSample
from trainer.loss import (
    MIN_PEERS,
    advantages,
    policy_gradient_loss,
    production_kl,
    state_baselines,
)

SERVED = datetime(2026, 6, 1, tzinfo=UTC)


def samples_of(
    rewards: Sequence[float],
    prompts: Sequence[object] | None = None,
    *,
    completions: Sequence[list[int]] | None = None,
    runs: Sequence[str | None] | None = None,
    **state: object,
) -> list[TrainingSample]:
    """Samples with these rewards; each prompt (a label) its own tokens, each sample its own
    run unless `runs` says otherwise, and the same state (`state`: TrainingSample fields)."""
    labels: dict[object, int] = {}
    return [
        TrainingSample(
            sample_id=i,
            prompt_token_ids=[labels.setdefault(prompt, len(labels) + 3), 1, 2],
            completion_token_ids=completions[i] if completions else [5, 6],
            behaviour_logprobs=[-1.0] * len(completions[i] if completions else [5, 6]),
            reward=reward,
            served_at=SERVED,
            trajectory_id=runs[i] if runs else None,
            **state,  # type: ignore[arg-type]
        )
        for i, (reward, prompt) in enumerate(
            zip(rewards, prompts if prompts is not None else range(len(rewards)), strict=True)
        )
    ]


def test_the_batch_baseline_centres_within_prompt_groups() -> None:
    adv = advantages(samples_of([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]), "batch")
    # Group b is all ones: no signal there, whatever the batch mean.
    assert adv[2] == 0 and adv[3] == 0
    assert adv[0] > 0 > adv[1]


def test_singletons_use_the_batch_mean_and_constant_rewards_give_zero() -> None:
    for baseline in ("batch", "state"):
        adv = advantages(samples_of([1.0, 0.0, 0.5]), baseline)  # type: ignore[arg-type]
        assert adv[0] > 0 > adv[1]
        assert torch.all(advantages(samples_of([0.3, 0.3]), baseline) == 0)  # type: ignore[arg-type]


def test_a_prompt_with_several_samples_is_its_own_baseline() -> None:
    rewards = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    adv = advantages(samples_of(rewards, ["a"] * 4 + ["b", "c", "d", "e"]))
    # Prompt a's four samples all earned 1: nothing to learn from them, whatever the others.
    assert torch.all(adv[:4] == 0)


def two_states(rng: random.Random, n: int = 200) -> list[TrainingSample]:
    """Agent first turns and one-turn chat answers, interleaved: the same spread of rewards
    (one noise, whatever the answer), around means 0.7 apart."""
    noise = [rng.gauss(0, 0.2) for _ in range(n)]
    agent = samples_of([0.8 + e for e in noise], tools_declared=True, edit_requested=True)
    chat = samples_of([0.1 + e for e in noise])
    return [sample for pair in zip(agent, chat, strict=True) for sample in pair]


def test_per_state_advantages_are_centred_in_each_state_where_the_batch_mean_leaves_an_offset() -> (
    None
):
    batch = two_states(random.Random(0))
    agent = torch.tensor([s.tools_declared for s in batch])
    by_state = advantages(batch, "state")
    by_batch = advantages(batch, "batch")

    for in_state in (agent, ~agent):
        assert abs(float(by_state[in_state].mean())) < 1e-5
    # One baseline for both: every agent turn looks good and every chat answer bad (about
    # ±0.87σ here), an offset that has nothing to do with what either answered.
    assert float(by_batch[agent].mean()) > 0.8 and float(by_batch[~agent].mean()) < -0.8


def test_a_state_with_too_few_samples_falls_back_to_a_coarser_one() -> None:
    first = samples_of([0.2, 0.4, 0.6, 0.8, 1.0], tools_declared=True, edit_requested=True)
    late = samples_of([0.0, 0.0], tools_declared=True, edit_requested=True, turn_index=4)
    chat = samples_of([5.0] * 4)
    baselines = state_baselines([*first, *late, *chat])

    assert MIN_PEERS > 1  # turn 3+ holds one peer for each of its two samples: too few
    # The agent turns' stratum, the other six of them; never the chat answers'.
    assert baselines[5] == pytest.approx((3.0 + 0.0) / 6)
    assert baselines[0] == pytest.approx((0.4 + 0.6 + 0.8 + 1.0) / 4)
    assert baselines[7] == pytest.approx(5.0)


def test_no_turn_of_a_samples_own_run_enters_its_baseline() -> None:
    # Five runs' turns 3, 4 and 5: one state (turn 3+), each run's turns side by side.
    runs = [f"r{k % 5}" for k in range(15)]
    batch = [
        dataclasses.replace(sample, turn_index=3 + k // 5)
        for k, sample in enumerate(
            samples_of([float(k % 4) for k in range(15)], runs=runs, tools_declared=True)
        )
    ]
    # Run r0's later turns credited otherwise (its last edit's fate, which its turn 3 decided):
    # its turn 3's baseline is unchanged, another run's is not.
    recredited = [
        dataclasses.replace(s, reward=9.0) if s.trajectory_id == "r0" and s.turn_index > 3 else s
        for s in batch
    ]
    before, after = state_baselines(batch), state_baselines(recredited)
    assert after[0] == before[0]
    assert after[1] > before[1]


def test_the_baseline_never_reads_what_the_sample_answered() -> None:
    rng = random.Random(1)
    tool_call, final_answer = [40, 41, 42, 43, 2], [50, 2]
    rewards = [rng.random() for _ in range(40)]
    called = [rng.random() < 0.5 for _ in rewards]
    state = {"tools_declared": True, "edit_requested": True, "turn_index": 1}
    calls = samples_of(
        rewards, completions=[tool_call if c else final_answer for c in called], **state
    )
    other_calls = samples_of(
        rewards, completions=[final_answer if c else tool_call for c in called], **state
    )
    assert torch.equal(state_baselines(calls), state_baselines(other_calls))


def _inputs(n: int = 4, t: int = 5) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    old = -torch.rand(n, t)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[0, :2] = False
    return old, mask


def test_gradient_raises_logprobs_of_positive_advantage_tokens() -> None:
    old, mask = _inputs()
    logprobs = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = policy_gradient_loss(logprobs, old, old, adv, mask, clip_epsilon=0.2, tis_cap=2.0)
    loss.backward()
    assert logprobs.grad is not None
    # Descending the loss moves positive-advantage tokens up and negative ones down.
    assert torch.all(logprobs.grad[1] > 0) and torch.all(logprobs.grad[2] < 0)
    assert torch.all(logprobs.grad[0, :2] == 0)  # padding gets no gradient
    assert stats.mean_ratio == 1.0 and stats.clip_fraction == 0.0


def test_clipped_tokens_get_no_gradient_and_are_counted() -> None:
    old, mask = _inputs()
    logprobs = (old + 0.5).requires_grad_(True)  # ratio e^0.5 ≈ 1.65, beyond 1 + 0.2
    adv = torch.ones(4)
    loss, stats = policy_gradient_loss(logprobs, old, old, adv, mask, clip_epsilon=0.2, tis_cap=2.0)
    loss.backward()
    assert logprobs.grad is not None and torch.all(logprobs.grad == 0)
    assert stats.clip_fraction == 1.0


def test_importance_weight_from_behaviour_policy_is_truncated() -> None:
    old, mask = _inputs()
    behaviour = old - 5.0  # vLLM thought these tokens were far less likely
    logprobs = old.clone().requires_grad_(True)
    _, stats = policy_gradient_loss(
        logprobs, old, behaviour, torch.ones(4), mask, clip_epsilon=0.2, tis_cap=2.0
    )
    assert stats.mean_tis_weight == 2.0


def test_the_kl_to_production_is_zero_there_and_adds_no_gradient() -> None:
    old, mask = _inputs()
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    gradients, kls = [], []
    for kl_coef in (0.0, 0.1):
        logprobs = old.clone().requires_grad_(True)
        loss, stats = policy_gradient_loss(
            logprobs, old, old, adv, mask, clip_epsilon=0.2, tis_cap=2.0, kl_coef=kl_coef
        )
        loss.backward()
        gradients.append(logprobs.grad)
        kls.append(stats.kl_to_production)
    assert kls == [0.0, 0.0]
    assert torch.equal(gradients[0], gradients[1])


def test_the_kl_term_pulls_a_moved_policy_back_toward_production() -> None:
    torch.manual_seed(0)
    production = torch.randn(8, 6, 20).log_softmax(-1)
    logits = (production + 0.5 * torch.randn(8, 6, 20)).requires_grad_(True)
    tokens = torch.distributions.Categorical(logits=production).sample()
    mask = torch.ones(8, 6, dtype=torch.bool)
    production_logprobs = production.gather(-1, tokens[..., None])[..., 0]

    def kl_loss() -> tuple[torch.Tensor, float]:
        logprobs = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        # No advantage: the loss is the KL term alone.
        loss, stats = policy_gradient_loss(
            logprobs,
            production_logprobs,
            production_logprobs,
            torch.zeros(8),
            mask,
            clip_epsilon=0.2,
            tis_cap=2.0,
            kl_coef=1.0,
        )
        return loss, stats.kl_to_production

    def exact_kl() -> float:
        policy = logits.detach().log_softmax(-1)
        return float((policy.exp() * (policy - production)).sum(-1).mean())

    loss, before = kl_loss()
    exact_before = exact_kl()
    loss.backward()
    with torch.no_grad():
        logits -= 10.0 * logits.grad  # type: ignore[operator]
    _, after = kl_loss()
    assert before > 0.05
    assert after < 0.7 * before
    assert exact_kl() < exact_before


def test_the_kl_estimate_is_k3_with_k2s_gradient() -> None:
    production = torch.tensor([-1.0, -2.0, -0.5])
    logprobs = torch.tensor([-1.5, -1.0, -0.5], requires_grad=True)
    kl = production_kl(logprobs, production)
    log_ratio = production - logprobs.detach()
    torch.testing.assert_close(kl.detach(), torch.exp(log_ratio) - log_ratio - 1)
    kl.sum().backward()
    # d/dlogprob of k2 = (production - logprob)^2 / 2: logprob - production.
    torch.testing.assert_close(logprobs.grad, -log_ratio)
