"""A vLLM general plugin, loaded in every vLLM process: keeps adapters off base-model tokens.

vLLM's PyTorch-native LoRA kernels, which its CPU backend uses, pick each token's adapter
weights with `stacked[token_slot]`, and a token of a request without an adapter has slot -1.
Python indexing turns -1 into the last slot, so once every LoRA slot (`--max-loras`) holds
an adapter, base-model requests batched with adapter requests are answered with the last
slot's adapter applied: production traffic silently served by some canary. (The Triton
kernels vLLM uses on GPUs skip slot -1.) Here the kernels see zero inputs for those tokens,
so their adapter term is zero, as it is on a GPU.

Registered under the `vllm.general_plugins` entry point in pyproject.toml; a no-op on
anything but the CPU backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

PATCHED_KERNELS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in PATCHED_KERNELS:
        kernel = getattr(lora_ops, name)
        if getattr(kernel, "skips_tokens_without_adapter", False):
            continue
        patched = skip_tokens_without_adapter(kernel)
        # `sgmv_*` call these through the module; the CPU wrapper imported them by name.
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, patched)


def skip_tokens_without_adapter(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel(inputs, weights, output, token_slots, ...)` with slot -1 rows contributing 0."""
    import torch

    @functools.wraps(kernel)
    def patched(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output: torch.Tensor,
        token_slots: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        without = token_slots < 0
        if token_slots.shape[0] == inputs.shape[0] and bool(without.any()):
            inputs = inputs.masked_fill(without.view(-1, *[1] * (inputs.dim() - 1)), 0)
            token_slots = token_slots.clamp(min=0)
        return kernel(inputs, weights, output, token_slots, *args, **kwargs)

    patched.skips_tokens_without_adapter = True  # type: ignore[attr-defined]
    return patched
