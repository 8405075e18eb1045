"""The trainable policy: the base model with a LoRA adapter continuing from production's."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from trainer.config import TrainConfig
from trainer.distributed import SINGLE, World

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(config: TrainConfig, world: World = SINGLE) -> torch.device:
    """The configured device, else this rank's GPU when there is one, else the CPU."""
    if config.device and config.device != "cuda":
        return torch.device(config.device)
    if config.device == "cuda" or torch.cuda.is_available():
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def policy_dtype(config: TrainConfig, device: torch.device) -> str:
    """bf16, fp16 or fp32: the configured one, or what vLLM serves on that device (auto)."""
    if config.dtype != "auto":
        return config.dtype
    return "bf16" if device.type == "cuda" else "fp32"


def load_trainable_policy(
    base_model: Path, production_adapter: Path | None, config: TrainConfig, device: torch.device
) -> PeftModel:
    """Production's adapter made trainable, or a fresh LoRA (equal to the base) when
    production is the base model itself. The base weights are in the policy's dtype; peft
    keeps the adapter's in fp32, so the optimizer steps in full precision."""
    dtype = TORCH_DTYPES[policy_dtype(config, device)]
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if config.gradient_checkpointing:
        # Non-reentrant: works under DDP and needs no inputs that require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if production_adapter is not None:
        policy = PeftModel.from_pretrained(model, production_adapter, is_trainable=True)
    else:
        modules = config.lora_target_modules
        policy = get_peft_model(
            model,
            LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                target_modules="all-linear" if modules == ["all-linear"] else modules,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            ),
        )
    return policy.to(device)
