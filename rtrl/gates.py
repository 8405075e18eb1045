"""The evaluation gate a deployment uses, by RTRL_TRAIN_EVAL_GATE and its base model."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine

from sandbox.agent_runs import agent_task_held_out
from sandbox.bases import SHIPPED_BASES, SUMS_FILE, shipped_base_dir
from sandbox.task_family import task_family_held_out
from trainer.config import EvalGate, TrainConfig
from trainer.evaluate import HeldOut
from trainer.logged_traffic import LoggedTrafficHeldOut


def is_shipped_base(model_dir: Path) -> bool:
    """Whether `model_dir` holds one of the bases the sandbox ships: its checksum list is
    theirs (the launcher verifies the files against it when the stack starts)."""
    sums = model_dir / SUMS_FILE
    if not sums.is_file():
        return False
    listed = sums.read_bytes()
    return any(
        listed == (shipped_base_dir(name) / SUMS_FILE).read_bytes() for name in SHIPPED_BASES
    )


def eval_gate_for(config: TrainConfig, base_model: Path | None) -> EvalGate:
    """The gate `config` asks for; `auto`: the toy task family on a base the sandbox ships
    (it only knows those tasks), production's withheld traffic on any other base."""
    if config.eval_gate != "auto":
        return config.eval_gate
    if base_model is None:
        raise ValueError("the auto evaluation gate needs the base model to choose a gate")
    return "task_family" if is_shipped_base(base_model) else "logged_traffic"


def held_out_for(config: TrainConfig, engine: Engine, base_model: Path | None = None) -> HeldOut:
    """`task_family`: the toy task family's held-out tasks, checked by running the code;
    `logged_traffic`: production's withheld traffic, kept against not kept completions;
    `agent_tasks`: held-out agent tasks, run offline with the workspace's tools; `auto`: one
    of the first two by `base_model` (`eval_gate_for`)."""
    gate = eval_gate_for(config, base_model)
    if gate == "agent_tasks":
        return agent_task_held_out(config)
    if gate == "logged_traffic":
        return LoggedTrafficHeldOut(
            engine,
            percent=config.eval_traffic_percent,
            cases=config.eval_tasks,
            max_batch_tokens=config.micro_batch_tokens,
        )
    return task_family_held_out(config)
