"""Training an agent run: each turn as its own sample (step-wise) vs the turns merged into one
sequence with a loss mask, when each turn's prompt starts with the previous turn's tokens.

An 8-turn run of the bootstrapped model's shape: turn t's prompt is turn t-1's prompt and
completion followed by a tool result, so step-wise training feeds the history again on every
turn (O(T^2) tokens) while the merged sequence feeds it once (O(T)); the loss covers only the
model's own tokens in both. Both sides run the same forward and backward on the same policy
(logprobs of every completion token, summed), from the same clock start, and the bench checks
that they compute the same logprobs before timing them.

    python -m bench.trajectory [--turns 8] [--completion 48] [--tool-result 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from app.serving.parity import batch_logprobs, completion_batch
from trainer.bootstrap import BootstrapConfig, bootstrap_model


def make_run(
    turns: int, first_prompt: int, completion: int, tool_result: int, vocab: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) token ids per turn; each prompt extends the previous turn."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(first_prompt)]
    run = []
    for _ in range(turns):
        answer = [rng.randrange(3, vocab) for _ in range(completion)]
        run.append((prompt, answer))
        prompt = [*prompt, *answer, *(rng.randrange(3, vocab) for _ in range(tool_result))]
    return run


def stepwise_logprobs(
    model: torch.nn.Module, run: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """Each turn a row of its own: the history is fed again on every turn."""
    batch = completion_batch([p for p, _ in run], [c for _, c in run])
    logprobs = batch_logprobs(model, batch)
    return logprobs[batch.completion_mask]


def merged_logprobs(model: torch.nn.Module, run: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """The last turn's prompt and completion as one row; only the completions carry loss."""
    last_prompt, last_completion = run[-1]
    sequence = torch.tensor([[*last_prompt, *last_completion]])
    targets = sequence[:, 1:]
    logits = model(input_ids=sequence).logits[:, :-1].float()
    picked = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)[0]
    mask = torch.zeros(sequence.shape[1] - 1, dtype=torch.bool)
    for prompt, completion in run:
        mask[len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
    return picked[mask]


def timed(
    step: object, model: torch.nn.Module, run: list[tuple[list[int], list[int]]], rounds: int
) -> float:
    """Seconds per forward + backward of the summed completion logprobs."""
    started = time.perf_counter()
    for _ in range(rounds):
        model.zero_grad()
        step(model, run).sum().backward()  # type: ignore[operator]
    return (time.perf_counter() - started) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first-prompt", type=int, default=80)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--tool-result", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, help="a bootstrapped model (default: build one)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as scratch:
        model_dir = args.model or Path(scratch) / "base"
        if args.model is None:
            bootstrap_model(model_dir, BootstrapConfig.small())
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        run = make_run(
            args.turns,
            args.first_prompt,
            args.completion,
            args.tool_result,
            model.config.vocab_size,
            seed=1,
        )
        longest = len(run[-1][0]) + len(run[-1][1])
        if longest > model.config.max_position_embeddings:
            raise SystemExit(f"the run is {longest} tokens, longer than the model's context")
        with torch.no_grad():
            difference = (stepwise_logprobs(model, run) - merged_logprobs(model, run)).abs().max()
        stepwise_tokens = sum(len(p) + len(c) for p, c in run)
        merged_tokens = longest
        trained = sum(len(c) for _, c in run)
        stepwise_s = timed(stepwise_logprobs, model, run, args.rounds)
        merged_s = timed(merged_logprobs, model, run, args.rounds)
    print(
        f"{args.turns}-turn run: {trained} trained tokens; step-wise feeds {stepwise_tokens} "
        f"tokens, merged {merged_tokens} ({stepwise_tokens / merged_tokens:.1f}x fewer)"
    )
    print(f"same logprobs: max |step-wise - merged| = {difference:.2e}")
    print(
        f"step-wise {trained / stepwise_s:8.0f} trained tokens/s  ({stepwise_s * 1000:.0f} ms "
        f"per forward+backward)"
    )
    print(
        f"merged    {trained / merged_s:8.0f} trained tokens/s  ({merged_s * 1000:.0f} ms "
        f"per forward+backward), {stepwise_s / merged_s:.1f}x step-wise"
    )


if __name__ == "__main__":
    main()
