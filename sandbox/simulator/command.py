"""`rtrl simulate`: synthetic developers using the gateway as an IDE plugin would."""

from __future__ import annotations

import asyncio

import typer

from app.config import get_settings
from app.db import make_engine
from sandbox.simulator.books import read_evidence, read_final_books
from sandbox.simulator.clients import CLIENT_MODES, ClientConfig
from sandbox.simulator.renderings import RENDERED_CLIENTS
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.run import Workload, run_simulation
from sandbox.tasks import Split

SPLITS: tuple[Split, ...] = ("train", "heldout", "all")


# Long by its options alone: Typer declares one parameter per option; the body is ~20 lines.
def simulate_command(
    gateway: str | None = typer.Option(
        None, "--gateway", help="Gateway base URL (default: RTRL_GATEWAY_HOST:PORT)."
    ),
    api_key: str = typer.Option(
        ..., "--api-key", envvar="RTRL_SIMULATOR_API_KEY", help="An `ide` API key."
    ),
    users: int = typer.Option(10, "--users", min=1, help="Developers in the population."),
    sessions: int | None = typer.Option(
        None,
        "--sessions",
        min=1,
        help="Sessions per developer (default 1, or unbounded with --duration).",
    ),
    tasks: int = typer.Option(5, "--tasks", min=1, help="Coding tasks per session."),
    duration: float | None = typer.Option(
        None, "--duration", min=0.001, help="Seconds during which sessions start and go on."
    ),
    rate: float | None = typer.Option(
        None, "--rate", min=0.001, help="Most sessions started per second, all developers together."
    ),
    time_scale: float = typer.Option(
        1.0,
        "--time-scale",
        min=0.0,
        help=(
            "Multiplies waits: 0.01 sends the 15-min survival report after 9 s (the workers"
            " count it only when started with RTRL_FEEDBACK_CLOCK_SKEW=PT16M or more)."
        ),
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the population and their tasks."),
    split: str = typer.Option("train", "--split", help="Task split: train, heldout or all."),
    concurrency: int = typer.Option(8, "--concurrency", min=1, help="Most requests in flight."),
    agent: bool = typer.Option(
        False,
        "--agent/--one-turn",
        help="Agent sessions: tools declared, each task a run of tool calls in a workspace.",
    ),
    client: str = typer.Option(
        "ideal",
        "--client",
        help="The IDE client: ideal (session ids, every signal), stock (no session header,"
        " no feedback), continue (Continue's own events on /v1/adapters/continue), or, with"
        " --agent, a stock agent played in its own words, no feedback: claude-code, codex,"
        " opencode or cline.",
    ),
    ide_closes: float = typer.Option(
        0.0,
        "--ide-closes",
        min=0.0,
        max=1.0,
        help="Ideal client: share of developers who close the IDE before the 10- and 15-minute"
        " survival windows (never reported).",
    ),
    rewards_timeout: float = typer.Option(
        0.0,
        "--rewards-timeout",
        min=0.0,
        help="Then wait up to this many seconds for the rewards to be final and print them"
        " (reads RTRL_DATABASE_URL); 0: don't.",
    ),
) -> None:
    """Run synthetic developers against the gateway and print what each checkpoint earned."""
    tasks_split, ide = checked_split(split), checked_client(client, ide_closes, agent=agent)
    settings = get_settings()
    url = gateway or f"http://{settings.gateway_host}:{settings.gateway_port}"
    typer.echo(f"simulating {users} developers against {url} ...")
    workload = Workload(
        users=users,
        sessions_per_user=sessions,
        duration_s=duration,
        rate=rate,
        tasks_per_session=tasks,
        time_scale=time_scale,
        seed=seed,
        split=tasks_split,
        concurrency=concurrency,
        agent=agent,
        client=ide,
    )
    report = asyncio.run(run_simulation(url, api_key, workload, progress=echo_progress))
    if rewards_timeout and report.served:
        await_final_rewards(report, settings.database_url, rewards_timeout)
    typer.echo(report.summary())
    if report.requests_sent and not report.requests_ok:
        raise typer.Exit(code=1)


def checked_split(split: str) -> Split:
    """`--split`, or the usage error that names it."""
    if split not in SPLITS:
        raise typer.BadParameter("must be train, heldout or all", param_hint="--split")
    return split


def checked_client(client: str, ide_closes: float, *, agent: bool = True) -> ClientConfig:
    """The IDE client `--client` and `--ide-closes` describe, or the usage error that names
    the option at fault."""
    if client not in CLIENT_MODES:
        raise typer.BadParameter(f"must be {', '.join(CLIENT_MODES)}", param_hint="--client")
    if client in RENDERED_CLIENTS and not agent:
        raise typer.BadParameter(
            f"{client} is an agent: it needs --agent (edits through tool calls)",
            param_hint="--client",
        )
    if ide_closes and client != "ideal":
        raise typer.BadParameter(
            "only the ideal client reports survival windows", param_hint="--ide-closes"
        )
    return ClientConfig(mode=client, ide_closes_share=ide_closes)


def echo_progress(report: SimulationReport) -> None:
    """One line as each session ends: sessions ended, requests answered of those sent."""
    typer.echo(
        f"  {report.sessions_ended} sessions ended, {report.requests_ok}/"
        f"{report.requests_sent} requests answered"
    )


def await_final_rewards(report: SimulationReport, database_url: str, timeout: float) -> None:
    """Wait up to `timeout` seconds for the report's rewards to be final, and add them to it."""
    typer.echo(f"waiting up to {timeout:.0f} s for the rewards to be final ...")
    engine = make_engine(database_url)
    try:
        report.rewards = read_final_books(engine, [report], timeout).rewards
        if report.client in RENDERED_CLIENTS:
            report.evidence = read_evidence(engine, [report])
    finally:
        engine.dispose()
