"""The `rtrl` command line: thin wrappers over the packages that own the work."""

from __future__ import annotations

import sys

import typer

from app.config import SettingsError, get_settings
from app.db import upgrade_schema
from app.embedded.kafka import DEFAULT_TOPICS, ensure_topics
from app.embedded.process import ServiceError
from app.embedded.stack import EmbeddedStack, ServiceStatus

cli = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
services_cli = typer.Typer(no_args_is_help=True, help="Embedded Postgres, Kafka and Redis.")
cli.add_typer(services_cli, name="services")


def _print_statuses(statuses: list[ServiceStatus]) -> None:
    typer.echo(f"{'service':<10} {'state':<10} {'pid':<8} url")
    for status in statuses:
        state = "external" if not status.embedded else "running" if status.running else "stopped"
        typer.echo(f"{status.name:<10} {state:<10} {status.pid or '-'!s:<8} {status.url}")


@services_cli.command("up")
def services_up() -> None:
    """Start the embedded services (idempotent), create topics, migrate the schema."""
    stack = EmbeddedStack.from_settings(get_settings())
    statuses = stack.up()
    _print_statuses(statuses)
    typer.echo("\n# point other shells at this stack:")
    for name, value in stack.environment().items():
        typer.echo(f"export {name}='{value}'")


@services_cli.command("down")
def services_down() -> None:
    """Stop the embedded services; their data stays under RTRL_DATA_DIR."""
    _print_statuses(EmbeddedStack.from_settings(get_settings()).down())


@services_cli.command("status")
def services_status() -> None:
    """Show each service: running, stopped, or external (a URL points elsewhere)."""
    statuses = EmbeddedStack.from_settings(get_settings()).status()
    _print_statuses(statuses)
    if any(s.embedded and not s.running for s in statuses):
        raise typer.Exit(code=3)


@cli.command("migrate")
def migrate() -> None:
    """Create the Kafka topics and apply database migrations against the configured URLs."""
    settings = get_settings()
    ensure_topics(settings.kafka_bootstrap_servers, DEFAULT_TOPICS)
    upgrade_schema(settings.database_url)
    typer.echo("topics present and schema at head")


def main() -> None:
    """Entry point: clear one-line errors instead of stack traces for known failures."""
    try:
        cli()
    except (SettingsError, ServiceError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
