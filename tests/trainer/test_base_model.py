"""The session's base model (the shipped `rtrl-base-500` every weight-needing test shares)
speaks tools and keeps the habits RL is meant to remove."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_base_model_speaks_tools_with_habits_left_for_rl(tiny_model_dir: Path) -> None:
    report = json.loads((tiny_model_dir / "bootstrap.json").read_text())
    first_turns = report["agent_first_turn_sampled"]
    # Sampled as vLLM serves it: mostly well-formed calls in the parser's format, and a
    # share of each planted habit.
    assert first_turns["call"] > 0.5
    assert first_turns["malformed"] > 0.02
    assert first_turns["question"] > 0.02
