"""`rtrl simulate` as wired into a Typer app."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from app.embedded.process import free_port
from app.simulator.command import simulate_command

cli = typer.Typer()
cli.command()(simulate_command)


def test_the_command_prints_the_report_and_fails_when_nothing_was_answered() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    arguments = ["--gateway", gone, "--api-key", "k", "--users", "2", "--tasks", "1"]
    result = CliRunner().invoke(cli, [*arguments, "--time-scale", "0"])
    assert result.exit_code == 1, result.output
    assert "requests: 2 sent, 0 ok, 2 failed" in result.output
    assert "chat:connection x2" in result.output


def test_an_unknown_split_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["--api-key", "k", "--split", "test"])
    assert result.exit_code == 2
    assert "--split" in result.output
