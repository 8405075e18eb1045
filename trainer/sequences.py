"""The sequences the update feeds: each turn a row of its own (step-wise), or the turns of a
run merged into one row with loss only on the model's own tokens.

An agent run's turn t is served on a prompt that holds turn t-1's prompt and completion and
then the tool results or the user's text. Step-wise, every turn is a row carrying the whole
history again (O(T^2) tokens for a T-turn run); merged, consecutive turns whose token ids
(prompt + completion, as vLLM served them) are an exact prefix of the next turn's prompt
are one row, the last turn's prompt and completion, in which each turn's completion tokens
are trained and everything between them is context (O(T)). Token positions, and so the
logprobs, are the same either way. A turn whose prompt does not start with the previous
turn's tokens (the client edited or compacted the history) starts a new row: a break.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.config import Layout
from trainer.data import TrainingSample


@dataclass(frozen=True)
class TrainingRow:
    """One sequence: its token ids, and the turns (sample indices) whose completions it
    trains, each starting at its position in the sequence."""

    token_ids: list[int]
    turns: list[int]
    starts: list[int]


@dataclass(frozen=True)
class RowLayout:
    rows: list[TrainingRow]
    breaks: int
    """Places where a run's next turn did not extend its previous one, so it was split."""

    @property
    def tokens_fed(self) -> int:
        """Tokens one pass over the rows feeds the model (padding not counted)."""
        return sum(len(row.token_ids) for row in self.rows)


def turn_row(samples: Sequence[TrainingSample], index: int) -> TrainingRow:
    """A turn alone: its prompt and completion."""
    sample = samples[index]
    return TrainingRow(
        [*sample.prompt_token_ids, *sample.completion_token_ids],
        [index],
        [len(sample.prompt_token_ids)],
    )


def extends(sample: TrainingSample, history: Sequence[int]) -> bool:
    """Whether `sample`'s prompt starts with exactly these token ids."""
    prompt = sample.prompt_token_ids
    return len(prompt) >= len(history) and prompt[: len(history)] == list(history)


def layout_rows(samples: Sequence[TrainingSample], layout: Layout) -> RowLayout:
    """The rows the update feeds for `samples` in `layout`, in the order of each row's first
    sample. Merged, a run's turns are chained in turn order (serve time, then id, among equals)
    and a turn that does not extend the chain's last turn starts a new row and counts a break."""
    if layout == "stepwise":
        return RowLayout([turn_row(samples, i) for i in range(len(samples))], breaks=0)
    runs: dict[str, list[int]] = {}
    for index, sample in enumerate(samples):
        if sample.trajectory_id is not None:
            runs.setdefault(sample.trajectory_id, []).append(index)
    chains: dict[int, list[int]] = {}  # first sample index -> the row's turns
    breaks = 0
    for turns in runs.values():
        turns.sort(
            key=lambda i: (samples[i].turn_index, samples[i].served_at, samples[i].sample_id)
        )
        chain = [turns[0]]
        for index in turns[1:]:
            last = samples[chain[-1]]
            if extends(samples[index], [*last.prompt_token_ids, *last.completion_token_ids]):
                chain.append(index)
                continue
            breaks += 1
            chains[min(chain)] = chain
            chain = [index]
        chains[min(chain)] = chain
    rows = []
    for index, sample in enumerate(samples):
        if sample.trajectory_id is None:
            rows.append(turn_row(samples, index))
        elif index in chains:
            chain = chains[index]
            last = samples[chain[-1]]
            rows.append(
                TrainingRow(
                    [*last.prompt_token_ids, *last.completion_token_ids],
                    chain,
                    [len(samples[i].prompt_token_ids) for i in chain],
                )
            )
    return RowLayout(rows, breaks)


@dataclass(frozen=True)
class RowBatch:
    """Rows left-padded into one batch, so that every row's last token is in the last column.

    The per-token tensors cover the last `width` positions, where every trained token lies:
    `targets[b, j]` is the token at position L - width + j, `trained` marks the completion
    tokens that carry loss, `turn_of` the sample each belongs to (-1 elsewhere), and
    `temperatures` that sample's sampling temperature."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    trained: torch.Tensor
    turn_of: torch.Tensor
    temperatures: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.targets.shape[1])

    def to(self, device: torch.device) -> RowBatch:
        return RowBatch(*(tensor.to(device) for tensor in vars(self).values()))

    def per_token(self, values: Sequence[Sequence[float]]) -> torch.Tensor:
        """Each trained token's value, from per-sample lists over its completion (0 elsewhere)."""
        out = torch.zeros(self.trained.shape)
        flat = [value for index in self._turn_order() for value in values[index]]
        return out.masked_scatter(self.trained, torch.tensor(flat, dtype=out.dtype))

    def per_turn(self, values: torch.Tensor) -> torch.Tensor:
        """Each trained token's value from a per-sample tensor, e.g. its turn's advantage."""
        return values[self.turn_of.clamp(min=0)] * self.trained

    def _turn_order(self) -> list[int]:
        """The samples in the order their trained tokens appear, row by row."""
        order: list[int] = []
        for row in self.turn_of.tolist():
            for index in row:
                if index >= 0 and (not order or order[-1] != index):
                    order.append(index)
        return order

    def split(self, logprobs: torch.Tensor) -> dict[int, list[float]]:
        """Per-token values of the trained tokens ([batch, width]) as each sample's list."""
        values = logprobs[self.trained].tolist()
        owners = self.turn_of[self.trained].tolist()
        result: dict[int, list[float]] = {}
        for owner, value in zip(owners, values, strict=True):
            result.setdefault(owner, []).append(value)
        return result


def row_batch(rows: Sequence[TrainingRow], samples: Sequence[TrainingSample]) -> RowBatch:
    """Left-pad `rows` into one batch."""
    length = max(len(row.token_ids) for row in rows)
    width = max(1, max(len(row.token_ids) - min(row.starts) for row in rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    trained = torch.zeros(len(rows), width, dtype=torch.bool)
    turn_of = torch.full((len(rows), width), -1, dtype=torch.long)
    temperatures = torch.ones(len(rows), width)
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        input_ids[b, length - n :] = torch.tensor(row.token_ids)
        attention_mask[b, length - n :] = 1
        offset = width - n  # row position q is column q + offset of the per-token tensors
        for index, start in zip(row.turns, row.starts, strict=True):
            sample = samples[index]
            end = start + len(sample.completion_token_ids)
            columns = slice(start + offset, end + offset)
            targets[b, columns] = torch.tensor(row.token_ids[start:end], dtype=torch.long)
            trained[b, columns] = True
            turn_of[b, columns] = index
            temperatures[b, columns] = sample.temperature
    # Positions restart at 0 on each row's first real token, as in vLLM.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return RowBatch(
        input_ids, attention_mask, position_ids, targets, trained, turn_of, temperatures
    )


def row_logprobs(model: torch.nn.Module, batch: RowBatch) -> torch.Tensor:
    """Logprobs of the trained tokens at their sampling temperature, [batch, width] (0
    elsewhere); differentiable."""
    # The logits before each token predict it: the last width + 1 positions cover them all.
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.width + 1,
    ).logits[:, :-1]
    # Only trained positions go through the softmax: a merged row's context is most of it.
    picked = logits[batch.trained].float() / batch.temperatures[batch.trained][:, None]
    chosen = picked.log_softmax(-1).gather(-1, batch.targets[batch.trained][:, None]).squeeze(-1)
    return torch.zeros(batch.trained.shape, device=chosen.device).masked_scatter(
        batch.trained, chosen
    )
