"""`rtrl simulate` as wired into a Typer app."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from app.processes import free_port
from sandbox.simulator.command import simulate_command

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


def test_the_client_is_chosen_on_the_command_line_and_named_in_the_report() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    arguments = ["--gateway", gone, "--api-key", "k", "--users", "1", "--tasks", "1"]
    result = CliRunner().invoke(cli, [*arguments, "--time-scale", "0", "--client", "stock"])
    assert result.exit_code == 1, result.output
    assert "client: stock" in result.output


@pytest.mark.parametrize(
    ("arguments", "option"),
    [
        (["--client", "zed"], "--client"),
        (["--client", "cline"], "--client"),  # a stock agent, without --agent
        (["--client", "stock", "--ide-closes", "0.3"], "--ide-closes"),
    ],
)
def test_a_client_the_simulator_does_not_play_is_a_usage_error(
    arguments: list[str], option: str
) -> None:
    result = CliRunner().invoke(cli, ["--api-key", "k", *arguments])
    assert result.exit_code == 2
    assert option in result.output
