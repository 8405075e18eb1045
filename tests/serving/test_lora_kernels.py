"""The CPU backend's LoRA kernels (`app.serving.vllm_plugin`) against vLLM's own, which they
replace in the server's processes."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops.torch_ops.lora_ops import (
    bgmv_expand as vllm_bgmv_expand,
)
from vllm.lora.ops.torch_ops.lora_ops import (
    bgmv_expand_slice as vllm_bgmv_expand_slice,
)
from vllm.lora.ops.torch_ops.lora_ops import (
    bgmv_shrink as vllm_bgmv_shrink,
)

from app.serving import vllm_plugin

LORAS, RANK, HIDDEN, OUT = 3, 8, 64, 96
MIXED = (0, 2, -1, 2, 1, -1, 0)
"""Token slots of a batch: three adapters, and base-model tokens (-1) between them."""


def without_base_tokens(
    inputs: torch.Tensor, token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's kernels must be given to compute a GPU's answer: base-model rows zeroed
    (no adapter term) and their slot made valid."""
    return inputs.masked_fill((token_slots < 0).unsqueeze(1), 0), token_slots.clamp(min=0)


@pytest.mark.parametrize("slots", [MIXED, (-1, -1, -1), (1,)])
@pytest.mark.parametrize("stacked_dims", [3, 4])
def test_shrink_matches_vllm_and_gives_base_tokens_no_adapter_term(
    slots: tuple[int, ...], stacked_dims: int
) -> None:
    token_slots = torch.tensor(slots)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(len(slots), HIDDEN, generator=generator)
    weights = torch.randn(LORAS, RANK, HIDDEN, generator=generator)
    if stacked_dims == 4:
        weights = weights.unsqueeze(1)
    ours, theirs = torch.full((len(slots), RANK), 5.0), torch.full((len(slots), RANK), 5.0)

    masked, clamped = without_base_tokens(inputs, token_slots)
    vllm_plugin.bgmv_shrink(inputs, weights, ours, token_slots, 0.5)
    vllm_bgmv_shrink(masked, weights, theirs, clamped, 0.5)

    assert torch.allclose(ours, theirs, atol=1e-5)
    assert not ours[token_slots < 0].any()


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("slots", [MIXED, (-1, -1)])
def test_expand_and_expand_slice_match_vllm(slots: tuple[int, ...], add_inputs: bool) -> None:
    token_slots = torch.tensor(slots)
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randn(len(slots), RANK, generator=generator)
    weights = torch.randn(LORAS, OUT, RANK, generator=generator)
    start = torch.randn(len(slots), OUT + 32, generator=generator)
    masked, clamped = without_base_tokens(inputs, token_slots)

    ours, theirs = start.clone(), start.clone()
    vllm_plugin.bgmv_expand(inputs, weights, ours, token_slots, add_inputs)
    vllm_bgmv_expand(masked, weights, theirs, clamped, add_inputs)
    assert torch.allclose(ours, theirs, atol=1e-5)

    ours, theirs = start.clone(), start.clone()
    vllm_plugin.bgmv_expand_slice(inputs, weights, ours, token_slots, 16, OUT, add_inputs)
    vllm_bgmv_expand_slice(masked, weights, theirs, clamped, 16, OUT, add_inputs)
    assert torch.allclose(ours, theirs, atol=1e-5)
    # Base-model rows: left as they were when adding, zero when assigning.
    base = ours[token_slots < 0, 16 : 16 + OUT]
    if add_inputs:
        assert torch.equal(base, start[token_slots < 0, 16 : 16 + OUT])
    else:
        assert not base.any()


def test_a_slot_count_that_fits_no_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match="3 token slots for 2 rows"):
        vllm_plugin.bgmv_shrink(
            torch.zeros(2, HIDDEN),
            torch.zeros(LORAS, RANK, HIDDEN),
            torch.zeros(2, RANK),
            torch.tensor([0, 1, 2]),
        )
