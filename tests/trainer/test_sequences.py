"""Agent runs fed as merged sequences: the same logprobs, loss and gradient as each turn alone,
loss only on the model's own tokens, and a run whose history was edited split there."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from trainer.config import Layout, TrainConfig
from trainer.data import TrainingSample
from trainer.drift import measure_drift
from trainer.loss import advantages
from trainer.policy import load_trainable_policy
from trainer.sequences import layout_rows, row_batch
from trainer.update import micro_batches, rows_loss, sharded_logprobs, update_policy

CONFIG = TrainConfig(
    epochs=1, minibatch_size=64, learning_rate=1e-3, lora_rank=4, seed=5, device="cpu"
)
SERVED = datetime(2026, 6, 1, tzinfo=UTC)
MODEL_TOKENS = range(3, 120)
"""The model's answers are drawn from these ids, tool results and user text from others."""
CONTEXT_TOKENS = range(120, 240)


def agent_run(
    rng: random.Random, run: str | None, turns: int, first_id: int, *, edited_at: int | None = None
) -> list[TrainingSample]:
    """A run's turns (None: a request alone): each prompt is the previous prompt and answer,
    then a tool result. At `edited_at` the client rewrote a token of the history (as
    compaction does)."""
    prompt = [rng.choice(CONTEXT_TOKENS) for _ in range(rng.randrange(6, 16))]
    samples = []
    for turn in range(turns):
        if turn == edited_at:
            prompt = [prompt[0] + 1, *prompt[1:]]
        answer = [rng.choice(MODEL_TOKENS) for _ in range(rng.randrange(2, 12))]
        samples.append(
            TrainingSample(
                sample_id=first_id + turn,
                prompt_token_ids=prompt,
                completion_token_ids=answer,
                behaviour_logprobs=[],
                reward=rng.uniform(-1, 1),
                served_at=SERVED + timedelta(seconds=first_id + turn),
                temperature=rng.choice([1.0, 0.7]),
                tools_declared=True,
                turn_index=turn,
                trajectory_id=run,
            )
        )
        result = [rng.choice(CONTEXT_TOKENS) for _ in range(rng.randrange(3, 10))]
        prompt = [*prompt, *answer, *result]
    return samples


def agent_batch() -> list[TrainingSample]:
    """Runs of 2 to 6 turns, one of them edited at its third turn, and lone chat requests,
    in serve order newest first as the cycle selects them."""
    rng = random.Random(0)
    samples: list[TrainingSample] = []
    for number in range(8):
        edited = 2 if number == 3 else None
        run = agent_run(rng, f"run-{number}", rng.randrange(2, 7), 100 * number, edited_at=edited)
        samples += run
    for number in range(5):
        samples += agent_run(rng, None, 1, 1000 + number)
    return sorted(samples, key=lambda s: s.served_at, reverse=True)


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[TrainingSample]:
    """The batch with behaviour logprobs near the untrained policy's, as vLLM logs them (off by
    a little, so the importance weights are not all 1)."""
    drafts = agent_batch()
    torch.manual_seed(CONFIG.seed)
    policy = load_trainable_policy(tiny_model_dir, None, CONFIG, torch.device("cpu"))
    logged = sharded_logprobs(policy, drafts, CONFIG.model_copy(update={"layout": "stepwise"}))
    noise = random.Random(1)
    return [
        dataclasses.replace(s, behaviour_logprobs=[v + noise.gauss(0, 0.2) for v in lp])
        for s, lp in zip(drafts, logged, strict=True)
    ]


def fresh_policy(model_dir: Path) -> torch.nn.Module:
    """The same LoRA every call, with B nonzero so the adapter already shapes the logprobs."""
    torch.manual_seed(CONFIG.seed)
    policy = load_trainable_policy(model_dir, None, CONFIG, torch.device("cpu"))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return policy


def loss_and_gradient(
    model_dir: Path,
    samples: list[TrainingSample],
    old: list[list[float]],
    layout: Layout,
    budget: int,
) -> tuple[float, dict[str, torch.Tensor]]:
    """One minibatch of the whole batch in `layout`, micro-batched under `budget` padded
    tokens as the update does: its token-mean loss and the LoRA's gradient."""
    config = CONFIG.model_copy(update={"layout": layout, "clip_epsilon": 0.2, "kl_coef": 0.1})
    policy = fresh_policy(model_dir)
    rows = layout_rows(samples, layout).rows
    advantage = advantages(samples, config.baseline)
    behaviour = [s.behaviour_logprobs for s in samples]
    total = sum(len(s.completion_token_ids) for s in samples)
    loss_sum = 0.0
    for group in micro_batches(range(len(rows)), [len(r.token_ids) for r in rows], budget):
        batch = row_batch([rows[r] for r in group], samples)
        loss, _ = rows_loss(policy, batch, old, behaviour, advantage, config)
        tokens = int(batch.trained.sum())
        (loss * tokens / total).backward()
        loss_sum += float(loss.detach()) * tokens / total
    gradient = {
        name: p.grad.clone()
        for name, p in policy.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    return loss_sum, gradient


def test_merged_rows_give_the_step_wise_logprobs_drift_loss_and_gradient(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    merged, stepwise = layout_rows(samples, "merged"), layout_rows(samples, "stepwise")
    runs = {s.trajectory_id for s in samples if s.trajectory_id is not None}
    lone = sum(s.trajectory_id is None for s in samples)
    assert len(stepwise.rows) == len(samples)
    assert len(merged.rows) == len(runs) + lone + 1  # the edited run is two rows
    print(f"tokens fed: step-wise {stepwise.tokens_fed}, merged {merged.tokens_fed}")
    assert merged.tokens_fed < 0.6 * stepwise.tokens_fed

    policy = fresh_policy(tiny_model_dir)
    logprobs = {
        layout: sharded_logprobs(policy, samples, CONFIG.model_copy(update={"layout": layout}))
        for layout in ("merged", "stepwise")
    }
    for ours, theirs, sample in zip(logprobs["merged"], logprobs["stepwise"], samples, strict=True):
        assert len(ours) == len(sample.completion_token_ids)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
    behaviour = [s.behaviour_logprobs for s in samples]
    drift = {
        layout: measure_drift(behaviour, values, tis_cap=CONFIG.tis_cap)
        for layout, values in logprobs.items()
    }
    assert drift["merged"].tokens == drift["stepwise"].tokens
    assert drift["merged"].mean_abs == pytest.approx(drift["stepwise"].mean_abs, abs=1e-6)
    assert drift["merged"].capped_share == drift["stepwise"].capped_share

    # The PPO ratio's denominator off the policy, so some ratios are clipped, and the
    # behaviour logprobs off both: every term of the loss is at work.
    noise = random.Random(2)
    old = [[v + noise.gauss(0, 0.3) for v in row] for row in logprobs["stepwise"]]
    merged_loss, merged_gradient = loss_and_gradient(
        tiny_model_dir, samples, old, "merged", budget=256
    )
    stepwise_loss, stepwise_gradient = loss_and_gradient(
        tiny_model_dir, samples, old, "stepwise", budget=256
    )
    assert merged_loss == pytest.approx(stepwise_loss, rel=1e-5)
    assert abs(merged_loss) > 1e-3
    assert merged_gradient.keys() == stepwise_gradient.keys()
    worst = 0.0
    for name, gradient in stepwise_gradient.items():
        scale = float(gradient.abs().max())
        worst = max(worst, float((merged_gradient[name] - gradient).abs().max()) / scale)
    # Sums in another order (rows of other widths): measured 4e-6 of each tensor's largest
    # element; one token with the wrong advantage or weight, or a context token trained,
    # changes it by a whole token's share (over 1e-3 here).
    print(f"largest gradient difference, relative to its tensor's largest element: {worst:.1e}")
    assert worst < 1e-4
    assert max(float(g.abs().max()) for g in merged_gradient.values()) > 1e-4


def test_an_update_moves_the_policy_alike_in_either_layout(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    """One optimizer step over the whole batch: the same step, whichever rows fed it."""
    moved = {}
    for layout in ("merged", "stepwise"):
        config = CONFIG.model_copy(update={"layout": layout})
        policy = fresh_policy(tiny_model_dir)
        old = sharded_logprobs(policy, samples, config)
        stats = update_policy(policy, samples, old, config, torch.device("cpu"), print)
        assert stats["optimizer_steps"] == 1
        assert stats["tokens"] == sum(len(s.completion_token_ids) for s in samples)
        assert stats["merge_breaks"] == (1 if layout == "merged" else 0)
        moved[layout] = {
            n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad
        }
    start = fresh_policy(tiny_model_dir).state_dict()
    assert any(
        float((tensor - start[name]).abs().max()) > 1e-4 for name, tensor in moved["merged"].items()
    )
    # Adam moves a weight by up to the learning rate in a step; summing in another order
    # moves it by far less (see test_update), a wrong loss by a whole step.
    for name, tensor in moved["stepwise"].items():
        torch.testing.assert_close(
            moved["merged"][name], tensor, rtol=0, atol=0.02 * CONFIG.learning_rate
        )


def test_a_run_whose_history_was_edited_is_split_there_and_counted() -> None:
    rng = random.Random(3)
    run = agent_run(rng, "edited", 5, 0, edited_at=3)
    lone = agent_run(rng, None, 1, 100)[0]
    samples = [lone, *reversed(run)]  # newest first, as selected

    layout = layout_rows(samples, "merged")

    assert layout.breaks == 1
    rows = sorted(
        [samples[i].turn_index for i in row.turns] for row in layout.rows if len(row.turns) > 1
    )
    assert rows == [[0, 1, 2], [3, 4]]
    for row in layout.rows:
        last = samples[row.turns[-1]]
        assert row.token_ids == [*last.prompt_token_ids, *last.completion_token_ids]
    assert layout_rows(samples, "stepwise").breaks == 0
    # A turn missing from the batch (held out, untrainable) breaks nothing: its tokens are
    # in the later turns' prompts, as context.
    without_turn_1 = [s for s in samples if s.turn_index != 1 or s.trajectory_id != "edited"]
    assert layout_rows(without_turn_1, "merged").breaks == 1


def test_tool_results_and_user_text_carry_no_loss(
    tiny_model_dir: Path, samples: list[TrainingSample]
) -> None:
    """In a merged row only the logits that predict the model's own tokens get a gradient."""
    rows = [row for row in layout_rows(samples, "merged").rows if len(row.turns) >= 4]
    batch = row_batch(rows, samples)
    trained_tokens = batch.targets[batch.trained]
    assert all(int(t) in MODEL_TOKENS for t in trained_tokens)
    expected = [t for row in rows for i in row.turns for t in samples[i].completion_token_ids]
    assert trained_tokens.tolist() == expected

    policy = fresh_policy(tiny_model_dir)
    kept: list[torch.Tensor] = []

    def keep_logits(module: torch.nn.Module, inputs: object, output: object) -> None:
        logits = output.logits  # type: ignore[attr-defined]
        logits.retain_grad()
        kept.append(logits)

    policy.register_forward_hook(keep_logits)
    advantage = torch.ones(len(samples))
    behaviour = [s.behaviour_logprobs for s in samples]
    loss, _ = rows_loss(policy, batch, behaviour, behaviour, advantage, CONFIG)
    loss.backward()
    grad = kept[0].grad
    assert grad is not None
    # logits[:, j] predict targets[:, j] (the last position predicts nothing).
    per_position = grad[:, :-1].abs().sum(-1)
    context = batch.attention_mask[:, -batch.width :].bool() & ~batch.trained
    assert bool(context.any())
    assert float(per_position[context].max()) == 0.0
    assert bool((per_position[batch.trained] > 0).all())
    assert float(grad[:, -1].abs().max()) == 0.0
