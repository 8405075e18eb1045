"""The evaluation gate a deployment uses, by RTRL_TRAIN_EVAL_GATE."""

from __future__ import annotations

from sqlalchemy import Engine

from sandbox.agent_runs import agent_task_held_out
from sandbox.task_family import task_family_held_out
from trainer.config import TrainConfig
from trainer.evaluate import HeldOut
from trainer.logged_traffic import LoggedTrafficHeldOut


def held_out_for(config: TrainConfig, engine: Engine) -> HeldOut:
    """`task_family`: the toy task family's held-out tasks, checked by running the code;
    `logged_traffic`: production's withheld traffic, kept against not kept completions;
    `agent_tasks`: held-out agent tasks, run offline with the workspace's tools."""
    if config.eval_gate == "agent_tasks":
        return agent_task_held_out(config)
    if config.eval_gate == "logged_traffic":
        return LoggedTrafficHeldOut(
            engine,
            percent=config.eval_traffic_percent,
            cases=config.eval_tasks,
            max_batch_tokens=config.micro_batch_tokens,
        )
    return task_family_held_out(config)
