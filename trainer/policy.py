"""The trainable policy: the base model with a LoRA adapter continuing from production's."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from trainer.config import TrainConfig


def pick_device(config: TrainConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_trainable_policy(
    base_model: Path, production_adapter: Path | None, config: TrainConfig, device: torch.device
) -> PeftModel:
    """Production's adapter made trainable, or a fresh LoRA (equal to the base) when
    production is the base model itself."""
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    if production_adapter is not None:
        policy = PeftModel.from_pretrained(model, production_adapter, is_trainable=True)
    else:
        policy = get_peft_model(
            model,
            LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                target_modules=config.lora_target_modules,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            ),
        )
    return policy.to(device)
