"""`RTRL_TRAIN_*`: the trainer's knobs from the environment, validated at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from app.config import SettingsError
from trainer.config import (
    TrainConfig,
    TrainSettings,
    load_train_settings,
    train_config_from_env,
    with_explicit_settings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RTRL_TRAIN_"):
            monkeypatch.delenv(name)


def test_defaults_are_the_config_defaults_and_every_knob_has_a_variable() -> None:
    assert train_config_from_env() == TrainConfig()
    assert set(TrainSettings.model_fields) == set(TrainConfig.model_fields)
    assert all(field.description for field in TrainConfig.model_fields.values())


def test_environment_sets_the_knobs_and_flags_override_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RTRL_TRAIN_DTYPE", "bfloat16")
    monkeypatch.setenv("RTRL_TRAIN_LORA_RANK", "8")
    monkeypatch.setenv("RTRL_TRAIN_LORA_ALPHA", "16")
    monkeypatch.setenv("RTRL_TRAIN_LORA_TARGET_MODULES", "q_proj, v_proj")
    monkeypatch.setenv("RTRL_TRAIN_LEARNING_RATE", "1e-5")
    monkeypatch.setenv("RTRL_TRAIN_MICRO_BATCH_TOKENS", "16384")
    monkeypatch.setenv("RTRL_TRAIN_GRADIENT_CHECKPOINTING", "true")
    monkeypatch.setenv("RTRL_TRAIN_DRIFT_KL", "0.05")
    monkeypatch.setenv("RTRL_TRAIN_DRIFT_MAX_ABS", "inf")
    monkeypatch.setenv("RTRL_TRAIN_EVAL_GATE", "logged_traffic")
    monkeypatch.setenv("RTRL_TRAIN_MIN_NEW_SAMPLES", "0")
    monkeypatch.setenv("RTRL_TRAIN_INTERVAL", "PT1H")  # the schedule's, not a knob here

    config = train_config_from_env(learning_rate=3e-4, epochs=None)

    assert config.dtype == "bf16"
    assert (config.lora_rank, config.lora_alpha) == (8, 16)
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    assert config.learning_rate == 3e-4  # the flag wins
    assert config.epochs == TrainConfig().epochs  # a flag not given changes nothing
    assert config.micro_batch_tokens == 16384 and config.gradient_checkpointing
    assert config.drift_kl == 0.05 and config.drift_max_abs == float("inf")
    assert config.drift_mean_abs is None  # the dtype's default
    assert config.eval_gate == "logged_traffic" and config.min_new_samples == 0


def test_a_caller_with_its_own_defaults_keeps_them_unless_a_variable_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    demo = TrainConfig(learning_rate=2e-3, epochs=4)
    monkeypatch.setenv("RTRL_TRAIN_EPOCHS", "1")
    config = with_explicit_settings(demo)
    assert (config.learning_rate, config.epochs) == (2e-3, 1)


def test_a_config_built_in_code_is_held_to_the_same_bounds_and_names() -> None:
    with pytest.raises(ValidationError, match="epochs"):
        TrainConfig(epochs=0)
    with pytest.raises(ValidationError, match="learning_rte"):
        TrainConfig(learning_rte=1e-3)  # type: ignore[call-arg]
    copy = TrainConfig().model_copy(update={"seed": 3})
    assert copy.seed == 3 and copy.epochs == TrainConfig().epochs


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("RTRL_TRAIN_DTYPE", "int8"),
        ("RTRL_TRAIN_LORA_RANK", "0"),
        ("RTRL_TRAIN_LORA_TARGET_MODULES", " , "),
        ("RTRL_TRAIN_LEARNING_RATE", "-1"),
        ("RTRL_TRAIN_CLIP_EPSILON", "1.5"),
        ("RTRL_TRAIN_TIS_CAP", "0.5"),
        ("RTRL_TRAIN_EPOCHS", "two"),
        ("RTRL_TRAIN_MICRO_BATCH_TOKENS", "0"),
        ("RTRL_TRAIN_GRADIENT_CHECKPOINTING", "maybe"),
        ("RTRL_TRAIN_DRIFT_CAPPED_SHARE", "2"),
        ("RTRL_TRAIN_EVAL_GATE", "vibes"),
        ("RTRL_TRAIN_DEVICE", "tpu"),
    ],
)
def test_invalid_values_fail_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as excinfo:
        load_train_settings()
    assert variable in str(excinfo.value)


def test_rtrl_train_stops_on_an_invalid_value_with_one_line() -> None:
    env = {**os.environ, "RTRL_TRAIN_DTYPE": "int8"}
    result = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "train", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "RTRL_TRAIN_DTYPE" in lines[0], result.stderr
