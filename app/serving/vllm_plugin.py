"""A vLLM general plugin, loaded in every vLLM process: LoRA kernels for the CPU backend that
keep adapters off base-model tokens and multiply once per adapter in the batch.

vLLM's PyTorch-native LoRA kernels, which its CPU backend uses, pick each token's adapter
weights with `stacked[token_slot]` and multiply token by token. Two things follow:

- A token of a request without an adapter has slot -1, and Python indexing turns -1 into
  the last slot: once every LoRA slot (`--max-loras`) holds an adapter, base-model requests
  batched with adapter requests are answered with the last slot's adapter applied,
  production traffic silently served by some canary. (The Triton kernels vLLM uses on GPUs
  skip slot -1.)
- The gather copies an adapter matrix for every token of the batch, adapter or not (a
  prefill of 3,000 tokens copies 3,000 of them per layer and projection).

The kernels here group the batch's tokens by slot and multiply each group by its adapter
once; tokens of slot -1 get a zero adapter term, as on a GPU. They write their result into
the output exactly as vLLM's kernels do (`bgmv_*` are what the `sgmv_*` prefill kernels and
the CPU punica wrapper call).

Measured by `python -m bench.agent_serving` (README, "Benchmarks").

Registered under the `vllm.general_plugins` entry point in pyproject.toml; a no-op on
anything but the CPU backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    kernels = {
        "bgmv_shrink": bgmv_shrink,
        "bgmv_expand": bgmv_expand,
        "bgmv_expand_slice": bgmv_expand_slice,
    }
    # `sgmv_*` call these through the module; the CPU wrapper imported them by name.
    for module in (lora_ops, torch_ops, punica_cpu):
        for name, kernel in kernels.items():
            if hasattr(module, name):
                setattr(module, name, kernel)


def adapter_terms(
    inputs: torch.Tensor, stacked: torch.Tensor, token_slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Row t of the result is `inputs[t] @ stacked[token_slots[t]].T`, and zeros where the
    slot is -1 (no adapter): one matrix product per adapter present."""
    import torch

    if stacked.dim() == 4:
        stacked = stacked.squeeze(dim=1)
    inputs = inputs.to(dtype=dtype)
    # vLLM's kernels broadcast a single row or a single slot; anything else is a bug upstream.
    if token_slots.shape[0] == 1:
        token_slots = token_slots.expand(inputs.shape[0])
    elif inputs.shape[0] == 1:
        inputs = inputs.expand(token_slots.shape[0], -1)
    if token_slots.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"{token_slots.shape[0]} token slots for {inputs.shape[0]} rows of LoRA input"
        )
    terms = inputs.new_zeros((inputs.shape[0], stacked.shape[1]))
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(dim=1)
        product = inputs.index_select(0, rows) @ stacked[slot].to(dtype=dtype).T
        terms.index_copy_(0, rows, product)
    return terms


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    terms = adapter_terms(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : terms.shape[1]] = scaling * terms


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    terms = adapter_terms(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if terms.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # The adapter and the model may pad their outputs differently.
    common = min(terms.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += terms[:limit, :common]
    else:
        output_tensor[:, :common] = terms[:limit, :common]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    terms = adapter_terms(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += terms
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = terms
