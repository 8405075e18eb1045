import torch

from trainer.loss import advantages, policy_gradient_loss


def test_advantages_are_centred_within_prompt_groups() -> None:
    adv = advantages([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"])
    # Group b is all ones: no signal there, whatever the batch mean.
    assert adv[2] == 0 and adv[3] == 0
    assert adv[0] > 0 > adv[1]


def test_singletons_use_the_batch_mean_and_constant_rewards_give_zero() -> None:
    adv = advantages([1.0, 0.0, 0.5], ["a", "b", "c"])
    assert adv[0] > 0 > adv[1]
    assert torch.all(advantages([0.3, 0.3], ["a", "b"]) == 0)


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


def test_kl_penalty_is_zero_at_the_base_and_positive_away_from_it() -> None:
    old, mask = _inputs()
    adv = torch.zeros(4)
    _, at_base = policy_gradient_loss(
        old, old, old, adv, mask, clip_epsilon=0.2, tis_cap=2.0, base_logprobs=old, kl_coef=0.1
    )
    _, away = policy_gradient_loss(
        old, old, old, adv, mask, clip_epsilon=0.2, tis_cap=2.0, base_logprobs=old - 1, kl_coef=0.1
    )
    assert at_base.kl_to_base == 0.0
    assert away.kl_to_base > 0.1
