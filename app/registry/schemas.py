"""What an experiment is made of, as ops specify it (validated before it reaches Postgres)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

NAME = r"^[A-Za-z0-9._:-]+$"
"""Names ops choose for experiments and arms: no spaces, quotes or path characters."""


class ArmIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=NAME)
    checkpoint: str = Field(min_length=1, max_length=64, pattern=NAME)
    weight_bps: int = Field(ge=0, le=10_000)
    is_control: bool = False


class ExperimentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=NAME)
    route: str = Field(default="chat", min_length=1, max_length=64, pattern=NAME)
    arms: list[ArmIn] = Field(min_length=2, max_length=10)
    start: bool = False
    """Start it right away (otherwise it is created as a draft)."""
