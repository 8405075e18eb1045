"""The evaluation gate a deployment gets: the toy task family only on a base the sandbox
ships, production's withheld traffic on any other, and whatever RTRL_TRAIN_EVAL_GATE names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from rtrl.gates import held_out_for
from sandbox.bases import HACKING_BASE, SUMS_FILE, install_base, shipped_base_dir
from sandbox.task_family import TaskFamilyHeldOut
from trainer.config import TrainConfig
from trainer.logged_traffic import LoggedTrafficHeldOut

ENGINE = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/rtrl")  # never connected


def another_base(tmp_path: Path) -> Path:
    """A model from elsewhere: the shipped base's files, retrained (its checksums differ)."""
    model_dir = tmp_path / "production-base"
    shutil.copytree(shipped_base_dir(HACKING_BASE), model_dir)
    sums = model_dir / SUMS_FILE
    sums.write_text(sums.read_text().replace("0", "1", 1))
    return model_dir


def test_a_base_the_sandbox_ships_gets_the_task_family_gate(tmp_path: Path) -> None:
    installed = install_base(HACKING_BASE, tmp_path / "base").path  # as `rtrl up` installs it
    gate = held_out_for(TrainConfig(), ENGINE, installed)
    assert isinstance(gate, TaskFamilyHeldOut) and gate.withheld_percent == 0


@pytest.mark.parametrize("checksums", [True, False])
def test_any_other_base_gets_the_logged_traffic_gate(tmp_path: Path, checksums: bool) -> None:
    model_dir = another_base(tmp_path)
    if not checksums:
        (model_dir / SUMS_FILE).unlink()
    gate = held_out_for(TrainConfig(eval_traffic_percent=20), ENGINE, model_dir)
    assert isinstance(gate, LoggedTrafficHeldOut) and gate.withheld_percent == 20


def test_a_gate_named_in_the_settings_is_kept_whatever_the_base(tmp_path: Path) -> None:
    config = TrainConfig(eval_gate="task_family")
    assert isinstance(held_out_for(config, ENGINE, another_base(tmp_path)), TaskFamilyHeldOut)
    config = TrainConfig(eval_gate="logged_traffic")
    shipped = shipped_base_dir(HACKING_BASE)
    assert isinstance(held_out_for(config, ENGINE, shipped), LoggedTrafficHeldOut)


def test_the_automatic_gate_needs_the_base() -> None:
    with pytest.raises(ValueError, match="base model"):
        held_out_for(TrainConfig(), ENGINE)
