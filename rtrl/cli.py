"""The `rtrl` command line: thin wrappers over the packages that own the work."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from app.auth.schemas import MAX_RATE_LIMIT_PER_MINUTE
from app.config import Settings, SettingsError, get_settings, refuse_development_secrets
from app.db import make_engine, session_scope, upgrade_schema
from app.heartbeat import heartbeat_age
from app.kafka.admin import DEFAULT_TOPICS, ensure_topics
from app.kafka.clients import kafka_security
from app.kafka.topics import (
    TopicDurabilityError,
    check_topic_durability,
    check_topics_if_reachable,
    configured,
)
from app.models import Checkpoint, Role
from app.processes import ServiceError
from app.serving.publish import (
    PublishError,
    ensure_base_checkpoint,
    publish_checkpoint,
    reconcile,
    retire_checkpoint,
)
from app.serving.replicas import ReplicaError
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack, ServiceStatus
from sandbox.bases import SHIPPED_BASES, BaseModelError, shipped_base_dir, verify_base
from sandbox.simulator.command import simulate_command
from trainer.config import load_train_settings, train_config_from_env, with_explicit_settings
from trainer.lock import CycleBusy

cli = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
services_cli = typer.Typer(no_args_is_help=True, help="Embedded Postgres, Kafka and Redis.")
cli.add_typer(services_cli, name="services")
checkpoints_cli = typer.Typer(no_args_is_help=True, help="Publish, list, retire checkpoints.")
cli.add_typer(checkpoints_cli, name="checkpoints")
model_cli = typer.Typer(no_args_is_help=True, help="The base model.")
cli.add_typer(model_cli, name="model")
rewards_cli = typer.Typer(no_args_is_help=True, help="Reward records.")
cli.add_typer(rewards_cli, name="rewards")
keys_cli = typer.Typer(no_args_is_help=True, help="API keys.")
cli.add_typer(keys_cli, name="keys")
spool_cli = typer.Typer(no_args_is_help=True, help="The gateways' event spools.")
cli.add_typer(spool_cli, name="spool")
history_cli = typer.Typer(no_args_is_help=True, help="Archived history.")
cli.add_typer(history_cli, name="history")
backup_cli = typer.Typer(
    no_args_is_help=True, help="Back up and restore the database and the checkpoints."
)
cli.add_typer(backup_cli, name="backup")
dlq_cli = typer.Typer(no_args_is_help=True, help="The workers' dead-letter topic.")
cli.add_typer(dlq_cli, name="dlq")


def _print_statuses(statuses: list[ServiceStatus]) -> None:
    from rtrl.launcher import StackRow, stack_state

    _print_rows(
        [StackRow(s.name, stack_state(s.embedded, s.running), s.pid, s.url) for s in statuses]
    )


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
    created = ensure_topics(
        settings.kafka_bootstrap_servers,
        DEFAULT_TOPICS,
        topic_configs={"max.message.bytes": str(settings.kafka_max_message_bytes)},
        security=kafka_security(settings),
        durability=configured(settings),
    )
    # Topics created before (or by hand) are held to the same settings.
    check_topic_durability(settings, DEFAULT_TOPICS)
    upgrade_schema(settings.database_url)
    if created.replication_factor < settings.kafka_replication_factor:
        typer.echo(
            "warning: a single-broker Kafka: topics are unreplicated"
            f" (RTRL_KAFKA_REPLICATION_FACTOR={settings.kafka_replication_factor} needs"
            f" {settings.kafka_replication_factor} brokers)",
            err=True,
        )
    typer.echo(
        f"topics present ({created.replication_factor} replica(s) a partition,"
        f" min.insync.replicas={created.min_insync_replicas}) and schema at head"
    )


@model_cli.command("bootstrap")
def model_bootstrap(
    force: bool = typer.Option(False, "--force", help="Rebuild even if a model exists."),
    recipe: str | None = typer.Option(
        None,
        help="Build a shipped base's recorded recipe (rtrl-base, rtrl-base-500) instead of"
        " the default configuration.",
    ),
    seed: int | None = typer.Option(None, help="Seed for the corpus, tokenizer and training."),
    steps: int | None = typer.Option(None, help="Pretraining steps (default: the config's)."),
    output: Path | None = typer.Option(
        None, help="Where to write the base (default: RTRL_DATA_DIR/models/base)."
    ),
) -> None:
    """Build a small base model and its tokenizer locally (rtrl ships its bases; this is for
    a new task family, a new size, or rebuilding a shipped one)."""
    import dataclasses
    import logging

    from sandbox.bootstrap import RECIPES, BootstrapConfig, bootstrap_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = get_settings()
    if recipe is not None and recipe not in RECIPES:
        raise ServiceError(f"no recipe named {recipe!r}; recipes: {', '.join(RECIPES)}")
    config = RECIPES[recipe] if recipe is not None else BootstrapConfig()
    if seed is not None:
        config = dataclasses.replace(config, seed=seed)
    if steps is not None:
        # Exactly the steps asked for: the agent-run check adds none.
        config = dataclasses.replace(config, train_steps=steps, min_agent_solved=0.0)
    target = output or settings.base_model_path
    try:
        report = bootstrap_model(target, config, force=force, progress_bar=True)
    except FileExistsError as exc:
        raise ServiceError(f"{exc}; pass --force to rebuild") from None
    if report.skipped:
        typer.echo(f"{report.output_dir} already holds a model; --force rebuilds it")
    typer.echo(f"base model at {report.output_dir}: {report.summary()}")
    typer.echo(f"identity: {verify_base(report.output_dir, recipe).describe()}")
    if report.agent_first_turn_sampled:
        shares = ", ".join(
            f"{kind} {share:.0%}" for kind, share in report.agent_first_turn_sampled.items()
        )
        typer.echo(f"first turns of held-out agent tasks (sampled): {shares}")


@model_cli.command("show")
def model_show(
    path: Path | None = typer.Argument(
        None,
        help="A base directory (default: the configured base, RTRL_BASE_MODEL or"
        " RTRL_DATA_DIR/models/base).",
    ),
    shipped: bool = typer.Option(False, "--shipped", help="Show the bases rtrl ships instead."),
) -> None:
    """Verify a base model against its checksums and print its identity and recipe; exits 1
    when a file does not match."""
    targets = (
        [(name, shipped_base_dir(name)) for name in SHIPPED_BASES]
        if shipped
        else [(None, path or get_settings().base_model_path)]
    )
    for name, model_dir in targets:
        try:
            identity = verify_base(model_dir, name)
        except BaseModelError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=1) from None
        typer.echo(identity.describe())
        typer.echo(f"  path: {identity.path}")
        if identity.checksum:
            typer.echo(f"  sha256: {identity.checksum}")
        built_on = identity.recipe.get("built_on")
        if built_on:
            typer.echo(
                f"  built on: {built_on.get('processor') or built_on.get('machine')}"
                f" ({', '.join(built_on.get('vector_extensions') or []) or 'no AVX2'}),"
                f" torch {built_on.get('torch')}"
            )


@model_cli.command("install")
def model_install(
    source: str = typer.Argument(
        "rtrl-base",
        help="A shipped base (rtrl-base, rtrl-base-500) or a directory holding a Hugging Face"
        " model and its SHA256SUMS.",
    ),
    to: Path | None = typer.Option(
        None, "--to", help="Where to install it (default: the configured base model path)."
    ),
    no_verify: bool = typer.Option(
        False,
        "--no-verify",
        help="Accept a directory without SHA256SUMS: its sums are computed as it is read and"
        " written into the copy. A file that differs from a SHA256SUMS is refused all the same.",
    ),
) -> None:
    """Install a base model, every file checked against its checksums, atomically; nothing to
    do when the directory already holds it (compose's model-init job runs it)."""
    from sandbox.bases import install_model

    target = to or get_settings().base_model_path
    present = (target / "config.json").is_file()
    if source in SHIPPED_BASES:
        identity = install_model(shipped_base_dir(source), target, name=source)
    elif Path(source).is_dir():
        identity = install_model(Path(source), target, verify=not no_verify)
    else:
        raise BaseModelError(
            f"{source!r} is neither a shipped base ({', '.join(SHIPPED_BASES)}) nor a directory"
        )
    done = "already installed, nothing to do" if present else "installed"
    typer.echo(f"{identity.describe()}: {done} at {target}")


@cli.command("serve")
def serve(
    detach: bool = typer.Option(False, help="Start in the background and return."),
    stop: bool = typer.Option(False, help="Stop a server started with --detach."),
) -> None:
    """Serve the base model and every live checkpoint with vLLM (LoRA hot-loading on).

    In the foreground, Ctrl-C, SIGTERM or SIGHUP stops the server."""
    settings = get_settings()
    server = VllmServer.from_settings(settings)
    if stop:
        server.stop()
        typer.echo("vllm stopped")
        return
    if not detach:
        _stop_signals_interrupt()
    typer.echo(f"starting vLLM for {settings.base_model_path} on {server.url} ...")
    started = time.monotonic()
    # From the start on, an interrupt (or a stop signal) anywhere stops the server: none may
    # fall between two statements and leave it running.
    stop_server = True
    try:
        server.start()
        typer.echo(
            f"vLLM healthy after {time.monotonic() - started:.1f} s (log: {server.log_file})"
        )
        _register_and_load(settings, server)
        if detach:
            stop_server = False
            typer.echo(
                f"serving in the background (pid {server.pid()}); stop with `rtrl serve --stop`"
            )
            return
        typer.echo("serving; Ctrl-C stops")
        while server.pid() is not None:
            time.sleep(1)
        raise ServiceError(f"vllm exited unexpectedly; see {server.log_file}")
    except KeyboardInterrupt:
        typer.echo("stopping vLLM ...")
    finally:
        if stop_server:
            server.stop()


def _register_and_load(settings: Settings, server: VllmServer) -> None:
    """The base model registered as checkpoint `base`, and every live checkpoint loaded."""
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            ensure_base_checkpoint(session, str(settings.base_model_path))
        report = reconcile(engine, [server.url], api_key=server.api_key)
    finally:
        engine.dispose()
    for replica, names in report.loaded.items():
        typer.echo(f"loaded on {replica}: {', '.join(names)}")
    for error in report.errors:
        typer.secho(f"warning: {error}", fg=typer.colors.YELLOW, err=True)


@checkpoints_cli.command("list")
def checkpoints_list() -> None:
    """Every checkpoint with its status, parent and adapter location."""
    engine = make_engine(get_settings().database_url)
    try:
        with session_scope(engine) as session:
            rows = session.scalars(select(Checkpoint).order_by(Checkpoint.id)).all()
            typer.echo(f"{'name':<12} {'status':<12} {'parent':<12} adapter")
            for row in rows:
                parent = row.parent.name if row.parent else "-"
                typer.echo(
                    f"{row.name:<12} {row.status:<12} {parent:<12} {row.adapter_path or '-'}"
                )
    finally:
        engine.dispose()


@checkpoints_cli.command("publish")
def checkpoints_publish(
    adapter_dir: Path = typer.Argument(..., help="A HF PEFT adapter directory."),
    parent: str = typer.Option("base", help="The checkpoint it was trained from."),
) -> None:
    """Store an adapter as the next `ckpt-<n>`, load it into every replica, register it."""
    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        row = publish_checkpoint(
            engine,
            adapter_dir,
            parent=parent,
            replicas=settings.vllm_urls,
            checkpoints_dir=settings.checkpoints_dir.resolve(),
            base_model=str(settings.base_model_path),
            api_key=settings.vllm_api_key.get_secret_value(),
        )
    finally:
        engine.dispose()
    typer.echo(f"published {row.name} ({row.status}); ask for it with model={row.name}")


@checkpoints_cli.command("retire")
def checkpoints_retire(name: str) -> None:
    """Retire a checkpoint and unload it from every replica."""
    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        failed = retire_checkpoint(
            engine, name, settings.vllm_urls, api_key=settings.vllm_api_key.get_secret_value()
        )
    finally:
        engine.dispose()
    typer.echo(f"retired {name}")
    for replica in failed:
        typer.secho(f"warning: {replica} still serves it until reconcile", err=True)


@checkpoints_cli.command("reconcile")
def checkpoints_reconcile() -> None:
    """Make every replica serve exactly the candidate, canary and production checkpoints."""
    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        report = reconcile(
            engine, settings.vllm_urls, api_key=settings.vllm_api_key.get_secret_value()
        )
    finally:
        engine.dispose()
    for replica in settings.vllm_urls:
        loaded = ", ".join(report.loaded.get(replica, [])) or "-"
        unloaded = ", ".join(report.unloaded.get(replica, [])) or "-"
        typer.echo(f"{replica}: loaded {loaded}; unloaded {unloaded}")
    if report.errors:
        raise ServiceError("; ".join(report.errors))


@cli.command("gateway")
def gateway(
    host: str | None = typer.Option(None, help="Bind address (default RTRL_GATEWAY_HOST)."),
    port: int | None = typer.Option(None, help="Port (default RTRL_GATEWAY_PORT)."),
    workers: int = typer.Option(
        1, min=1, help="Processes sharing the port, each with its own spool directory."
    ),
) -> None:
    """Serve the OpenAI-compatible gateway, feedback, admin and analytics APIs (uvicorn)."""
    from app.main import run_gateway

    settings = get_settings()
    updates = {k: v for k, v in {"gateway_host": host, "gateway_port": port}.items() if v}
    refuse_development_secrets(settings)  # before anything is reached or logged
    check_topics_if_reachable(settings, DEFAULT_TOPICS)
    run_gateway(settings.model_copy(update=updates), workers=workers)


@spool_cli.command("replay")
def spool_replay(
    since: str | None = typer.Option(
        None, help="Only events spooled since: an ISO 8601 time, or a duration ago (PT2H)."
    ),
    timeout: float = typer.Option(300.0, help="Seconds to wait for Kafka to take them."),
) -> None:
    """Send the retained events of stopped gateways' spools to Kafka again (workers dedupe)."""
    from app.gateway.replay import parse_since, replay_spools
    from app.gateway.spool import Retention

    settings = get_settings()
    try:
        start = parse_since(since) if since else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None
    report = replay_spools(
        settings.kafka_bootstrap_servers,
        settings.spool_dir,
        Retention(settings.spool_retention, settings.spool_retention_bytes),
        since=start,
        timeout_s=timeout,
        security=kafka_security(settings),
    )
    sent = report.retained + report.pending - report.left
    typer.echo(
        f"sent {sent} events from {len(report.spools)} spools in {report.seconds:.1f} s "
        f"({report.retained} retained sent again, {report.pending} not yet delivered)"
    )
    for directory in report.held:
        typer.secho(
            f"error: {directory} is held by a running gateway, which sends its retained "
            "events again itself when it sees the broker lost them; stop it to replay by hand",
            fg=typer.colors.RED,
            err=True,
        )
    if report.left:
        typer.secho(
            f"error: Kafka at {settings.kafka_bootstrap_servers} did not take {report.left} "
            f"events within {timeout:.0f} s; they stay spooled",
            fg=typer.colors.RED,
            err=True,
        )
    if report.held or report.left:
        raise typer.Exit(1)


@keys_cli.command("create")
def keys_create(
    name: str = typer.Option(..., help="Who or what the key is for."),
    role: Role = typer.Option(..., help="ide (gateway), ops (admin) or analyst (analytics)."),
    privacy: bool = typer.Option(False, help="Never log content for this key's traffic."),
    rate_limit: int | None = typer.Option(
        None,
        min=1,
        max=MAX_RATE_LIMIT_PER_MINUTE,
        help="Requests per minute for this key (default: RTRL_RATE_LIMIT_PER_MINUTE).",
    ),
) -> None:
    """Create an API key; the secret is printed once and stored only as a hash."""
    from app.auth.service import new_api_key

    engine = make_engine(get_settings().database_url)
    try:
        with session_scope(engine) as session:
            row, secret = new_api_key(
                name=name,
                role=role,
                privacy_mode=privacy,
                rate_limit_per_minute=rate_limit,
                created_by="cli",
            )
            session.add(row)
    finally:
        engine.dispose()
    typer.echo(secret)


@cli.command("up")
def up(
    workers: int = typer.Option(1, help="Worker processes."),
    trainer: bool = typer.Option(True, help="Run the training scheduler too."),
    detach: bool = typer.Option(False, help="Leave the stack running and return."),
    down: bool = typer.Option(False, "--down", help="Stop a stack started with --detach."),
    bootstrap: bool = typer.Option(
        False,
        "--bootstrap",
        help="Train the base model (minutes) instead of installing the shipped one, when the"
        " data dir has none.",
    ),
) -> None:
    """The whole embedded stack: services, base model, vLLM, gateway, workers, trainer.

    In the foreground, Ctrl-C, SIGTERM or SIGHUP stops everything it started."""
    from rtrl.launcher import FullStack

    _stop_signals_interrupt()
    if trainer and not down:
        load_train_settings()  # the trainer would stop on a bad RTRL_TRAIN_* value: stop now
    stack = FullStack.from_settings(
        get_settings(), workers=workers, trainer=trainer, progress=typer.echo, bootstrap=bootstrap
    )
    if down:
        _print_rows(stack.down())
        return
    # An interrupt (or a stop signal) from here on, even between two lines, stops what was
    # started.
    try:
        rows = stack.up()
        _print_rows(rows)
        typer.echo(f"\nlogs: {get_settings().logs_dir.resolve()}")
        if detach:
            typer.echo("running in the background; `rtrl up --down` stops it")
            return
        typer.echo("Ctrl-C stops everything")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        typer.echo("\nstopping ...")
        _print_rows(stack.down())
    except BaseException:
        typer.echo("start-up failed; stopping what was started")
        stack.down()
        raise


def _stop_signals_interrupt() -> None:
    """SIGTERM and SIGHUP (a process manager's stop, a closed terminal) raise KeyboardInterrupt
    as Ctrl-C does, so a foreground command stops the detached processes it started instead
    of dying and leaving them running."""
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.default_int_handler)


def _print_rows(rows: list[Any]) -> None:
    typer.echo(f"{'part':<10} {'state':<10} {'pid':<8} url")
    for row in rows:
        typer.echo(f"{row.name:<10} {row.state:<10} {row.pid or '-'!s:<8} {row.url}")


@cli.command("worker")
def worker(
    group_id: str = typer.Option("rtrl-workers", help="Kafka consumer group."),
    max_records: int = typer.Option(2000, help="Messages per batch (one DB transaction)."),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Consume completions and feedback into samples and rewards until SIGTERM/Ctrl-C."""
    from workers.__main__ import main as worker_main

    worker_main(
        ["--group-id", group_id, "--max-records", str(max_records), "--log-level", log_level]
    )


@rewards_cli.command("recompute")
def rewards_recompute(
    version: int = typer.Option(..., "--version", help="Reward formula version to apply."),
) -> None:
    """Replay reward formula VERSION over the stored components of every finalized reward."""
    from workers.sweep import recompute_rewards

    engine = make_engine(get_settings().database_url)
    try:
        changed = recompute_rewards(engine, version)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--version") from None
    finally:
        engine.dispose()
    typer.echo(f"recomputed {changed} finalized rewards with formula version {version}")


@cli.command("maintain")
def maintain() -> None:
    """Create history partitions ahead; archive to Parquet and drop days past RTRL_RETENTION."""
    from app.history.service import maintain as maintain_history

    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        report = maintain_history(
            engine,
            settings.history_archive_url,
            retention=settings.retention,
            days_ahead=settings.partitions_ahead,
        )
    except OperationalError as exc:
        raise ServiceError(f"Postgres unavailable: {exc.orig}") from None
    except OSError as exc:
        raise ServiceError(f"archive {settings.history_archive_url}: {exc}") from None
    finally:
        engine.dispose()
    typer.echo(f"created {len(report.created)} partitions: {', '.join(report.created) or '-'}")
    for name, rows in report.archived.items():
        typer.echo(f"archived {rows} rows of {name}")
    typer.echo(f"dropped {len(report.dropped)} partitions: {', '.join(report.dropped) or '-'}")
    if settings.retention is None:
        typer.echo("no RTRL_RETENTION: nothing archived")
    for day in report.kept_for_training:
        typer.echo(f"kept {day}: past the retention, but the production checkpoint trains on it")


@history_cli.command("import")
def history_import(
    url: str = typer.Argument(..., help="The archive: a directory or an fsspec URL (s3://...)."),
) -> None:
    """Read an archive back into the database at RTRL_DATABASE_URL (migrated first)."""
    from app.history.service import import_history

    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        upgrade_schema(settings.database_url)
        report = import_history(engine, url)
    except FileNotFoundError as exc:
        raise typer.BadParameter(f"no archive there: {exc}", param_hint="URL") from None
    except OperationalError as exc:
        raise ServiceError(f"Postgres unavailable: {exc.orig}") from None
    except OSError as exc:
        raise ServiceError(f"archive {url}: {exc}") from None
    finally:
        engine.dispose()
    for table, rows in report.read.items():
        typer.echo(f"{table}: {rows} rows read, {report.inserted[table]} new")


@dlq_cli.command("replay")
def dlq_replay(
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Count the letters and list their reasons; send nothing."
    ),
    since: str | None = typer.Option(
        None,
        help="Pass over letters dead-lettered before: an ISO 8601 time, or a duration ago"
        " (PT2H). Passed over counts as read: a later replay does not see them again.",
    ),
    limit: int | None = typer.Option(
        None, min=1, help="Re-drive at most this many messages; the next replay goes on."
    ),
    group: str = typer.Option(
        "rtrl-dlq-replay",
        help="The consumer group that records how far replays got (another reads it all again).",
    ),
) -> None:
    """Send the messages in rtrl.dlq.v1 back to the topics they came from, each once; letters
    that hold no whole message (privacy mode, cut to size, over Kafka's limit) are counted."""
    from kafka.errors import KafkaError

    from app.gateway.replay import parse_since
    from workers.config import WorkerConfig
    from workers.dlq import ReplayError, replay_dead_letters

    settings = get_settings()
    try:
        start = parse_since(since) if since else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from None
    config = WorkerConfig.from_settings(settings)
    try:
        report = replay_dead_letters(
            settings,
            config,
            group_id=group,
            since=start,
            limit=limit,
            dry_run=dry_run,
            progress=typer.echo,
        )
    except (ReplayError, KafkaError) as exc:
        typer.secho(f"error: {config.dlq_topic}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    verb = "would re-drive" if dry_run else "re-drove"
    typer.echo(f"{verb} {sum(report.redriven.values())} messages of {report.read} letters read")
    for topic, count in sorted(report.redriven.items()):
        typer.echo(f"  {count} to {topic}")
    for why, count in report.not_replayable.most_common():
        typer.echo(f"not replayable: {count} ({why})")
    if report.passed_over:
        typer.echo(f"passed over: {report.passed_over} dead-lettered before {start}")
    for kind, count in report.reasons.most_common():
        typer.echo(f"reason: {count} {kind} (e.g. {report.examples[kind][:200]})")
    if report.left:
        stop = "--limit" if report.stopped_at_limit else "the letters stopped coming"
        typer.echo(f"{report.left} letters left for the next replay ({stop})")


@backup_cli.command("create")
def backup_create(
    directory: Path = typer.Argument(..., help="Where to write the backup (new, or empty)."),
    pg_bin: Path | None = typer.Option(
        None, help="Directory of the pg_dump to use (default: the one rtrl installs)."
    ),
) -> None:
    """Dump the database and copy the adapter of every checkpoint its registry names, with a
    manifest of checksums; the directory appears only once the backup is complete."""
    from rtrl.backup import create_backup

    manifest = create_backup(get_settings().database_url, directory, pg_bin=pg_bin)
    size = sum((directory / name).stat().st_size for name in manifest.files)
    typer.echo(
        f"backed up {len(manifest.checkpoints)} checkpoints ({len(manifest.adapters)} adapters;"
        f" production {manifest.production}) and the database (schema"
        f" {manifest.schema_revision}, {manifest.erased_users} erased users) to {directory}:"
        f" {size / 1e6:.1f} MB in {manifest.seconds:.1f} s"
    )


@backup_cli.command("verify")
def backup_verify(directory: Path = typer.Argument(..., help="A backup directory.")) -> None:
    """Check every file of a backup against its manifest; exits 1 naming what is damaged."""
    from rtrl.backup import verify_backup

    manifest = verify_backup(directory)
    typer.echo(
        f"{directory}: intact; taken {manifest.created_at}, {len(manifest.files)} files,"
        f" production {manifest.production}"
    )


@backup_cli.command("restore")
def backup_restore(
    directory: Path = typer.Argument(..., help="A backup directory."),
    erasure_log: list[Path] = typer.Option(
        [],
        "--erasure-log",
        help="An erasure log (`rtrl backup erasures`) to apply after the restore; repeatable.",
    ),
    without_erasure_log: bool = typer.Option(
        False,
        "--without-erasure-log",
        help="Restore without one: only when no user was erased since the backup was taken.",
    ),
    pg_bin: Path | None = typer.Option(
        None, help="Directory of the pg_restore to use (default: the one rtrl installs)."
    ),
) -> None:
    """Restore a backup into an empty database and RTRL_DATA_DIR/checkpoints, then erase
    again every user the erasure log erased after the backup was taken."""
    from rtrl.backup import read_erasure_log, restore_backup

    if not erasure_log and not without_erasure_log:
        raise typer.BadParameter(
            "a backup cannot hold the erasures made after it: pass the erasure log kept"
            " outside the database, or --without-erasure-log if no user was erased since",
            param_hint="--erasure-log",
        )
    erasures = [erasure for path in erasure_log for erasure in read_erasure_log(path)]
    settings = get_settings()
    report = restore_backup(
        directory, settings.database_url, settings.checkpoints_dir, erasures, pg_bin=pg_bin
    )
    seconds = ", ".join(f"{step} {value:.1f} s" for step, value in report.seconds.items())
    typer.echo(
        f"restored {report.checkpoints} checkpoints (production {report.production});"
        f" adapters copied: {', '.join(report.adapters_copied) or '-'},"
        f" already in place: {', '.join(report.adapters_present) or '-'}"
    )
    typer.echo(
        f"erased again {len(report.erasures_applied)} users erased after the backup"
        f" ({report.rows_erased} rows)"
    )
    if report.sequence_moved_to is not None:
        typer.echo(f"checkpoint numbers go on after ckpt-{report.sequence_moved_to} (on disk)")
    typer.echo(f"took {seconds}; load the live checkpoints with `rtrl checkpoints reconcile`")


@backup_cli.command("erasures")
def backup_erasures(
    output: Path = typer.Argument(..., help="The erasure log (JSON lines), created or merged."),
) -> None:
    """Write every erasure the database records into an erasure log kept outside it, for a
    restore to apply; entries already in the file are kept."""
    from rtrl.backup import export_erasures

    count = export_erasures(get_settings().database_url, output)
    typer.echo(f"{count} erased users in {output}")


@backup_cli.command("apply-erasures")
def backup_apply_erasures(
    erasure_logs: list[Path] = typer.Argument(..., help="Erasure logs (`rtrl backup erasures`)."),
) -> None:
    """Erase again every user the logs erased later than the database knows: after a restore
    by other means (point-in-time recovery, a provider's snapshot). Repeatable."""
    from rtrl.backup import apply_erasures, read_erasure_log

    erasures = [erasure for path in erasure_logs for erasure in read_erasure_log(path)]
    applied, rows = apply_erasures(get_settings().database_url, erasures)
    typer.echo(f"erased again {len(applied)} users ({rows} rows); the others were already erased")


@cli.command("train")
def train(
    once: bool = typer.Option(True, "--once", help="Run one cycle now and exit."),
    min_samples: int | None = typer.Option(
        None, min=1, help="Skip below this many samples (default: RTRL_TRAIN_MIN_SAMPLES)."
    ),
    learning_rate: float | None = typer.Option(
        None, min=0.0, help="AdamW learning rate (default: RTRL_TRAIN_LEARNING_RATE)."
    ),
    epochs: int | None = typer.Option(
        None, min=1, help="Passes over the batch (default: RTRL_TRAIN_EPOCHS)."
    ),
) -> None:
    """Run one training cycle on the production checkpoint's rewards (`--once`); under
    `torchrun --nproc-per-node N` it trains on N devices."""
    from rtrl.gates import held_out_for
    from trainer.cycle import run_cycle
    from trainer.distributed import join_world, leave_world

    settings = get_settings()
    config = train_config_from_env(
        min_samples=min_samples, learning_rate=learning_rate, epochs=epochs
    )
    world = join_world()
    engine = make_engine(settings.database_url)
    try:
        result = run_cycle(
            settings,
            config,
            engine=engine,
            held_out=held_out_for(config, engine, settings.base_model_path),
            progress=typer.echo if world.is_main else (lambda line: None),
            world=world,
        )
    finally:
        engine.dispose()
        leave_world(world)
    if world.is_main:
        typer.echo(
            f"run {result.run_id}: {result.status}"
            + (f" ({result.reason})" if result.reason else "")
            + (f" -> {result.checkpoint}" if result.checkpoint else "")
        )


@cli.command("healthcheck")
def healthcheck(
    heartbeat: Path = typer.Option(..., help="The heartbeat file the process touches."),
    max_age: float = typer.Option(60.0, help="Seconds since the last beat before it fails."),
) -> None:
    """Exit 0 while a worker's or trainer's heartbeat is fresh, 1 otherwise (compose probes)."""
    age = heartbeat_age(heartbeat)
    if age is None:
        typer.echo(f"unhealthy: no heartbeat at {heartbeat}", err=True)
        raise typer.Exit(1)
    if age > max_age:
        typer.echo(f"unhealthy: last heartbeat {age:.0f} s ago (limit {max_age:.0f} s)", err=True)
        raise typer.Exit(1)
    typer.echo(f"healthy: last heartbeat {age:.1f} s ago")


@cli.command("trainer")
def trainer_loop() -> None:
    """Run a training cycle every RTRL_TRAIN_INTERVAL until interrupted (one at a time);
    under `torchrun --nproc-per-node N` each cycle trains on N devices."""
    import logging
    import signal
    import threading

    from app.metrics import serve_metrics
    from rtrl.gates import held_out_for
    from trainer.distributed import join_world, leave_world
    from trainer.metrics import load_last_finished
    from trainer.scheduler import run_scheduler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    config = train_config_from_env()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    world = join_world()
    engine = make_engine(settings.database_url)
    if world.is_main and settings.metrics_port is not None:
        serve_metrics(settings.metrics_port)
        load_last_finished(engine)
    try:
        run_scheduler(
            settings,
            config,
            engine=engine,
            held_out=held_out_for(config, engine, settings.base_model_path),
            stop=stop,
            world=world,
        )
    except KeyboardInterrupt:
        pass
    finally:
        engine.dispose()
        leave_world(world)


cli.command("simulate")(simulate_command)


@cli.command("demo")
def demo(
    cycles: int | None = typer.Option(
        None, min=1, help="Training cycles (default: 2; 3 in the reward-hacking scenario)."
    ),
    users: int = typer.Option(24, help="Developers whose traffic each cycle trains on."),
    eval_users: int | None = typer.Option(
        None,
        min=2,
        help="Privacy-mode developers evaluating each canary (default: 40; 48 in the"
        " reward-hacking scenario, for its monitors).",
    ),
    keep_running: bool = typer.Option(False, help="Leave the stack up after the summary."),
    agent: bool = typer.Option(
        True, "--agent/--one-turn", help="Agent sessions (tools, workspaces) or one-turn answers."
    ),
    scenario: str = typer.Option(
        "learning",
        "--scenario",
        help="learning, or reward-hacking: start on a flawed reward and watch the monitors.",
    ),
    offline_runs: int = typer.Option(
        400,
        min=0,
        help="Agent mode: held-out runs per model sampled offline at the end (0: none).",
    ),
    bootstrap: bool = typer.Option(
        False,
        "--bootstrap",
        help="Train the base model (minutes) instead of installing the shipped one, when the"
        " data dir has none.",
    ),
    seed: int = typer.Option(
        0,
        min=0,
        help="Which tasks and developers (0: the documented run); `python -m bench.demo_seeds`"
        " runs several.",
    ),
) -> None:
    """The closed loop: traffic, rewards, training cycles, canaries, A/B results, summary."""
    from rtrl.demo import (
        SCENARIO_CYCLES,
        SCENARIO_EVAL_USERS,
        DemoConfig,
        demo_train_config,
        run_demo,
    )

    if scenario not in ("learning", "reward-hacking"):
        raise typer.BadParameter("must be learning or reward-hacking", param_hint="--scenario")
    config = DemoConfig(
        cycles=cycles or SCENARIO_CYCLES[scenario],  # type: ignore[index]
        train_users=users,
        eval_users=eval_users or SCENARIO_EVAL_USERS[scenario],  # type: ignore[index]
        keep_running=keep_running,
        agent=agent,
        scenario=scenario,  # type: ignore[arg-type]
        offline_runs=offline_runs,
        bootstrap_base=bootstrap,
        seed=seed,
        train=demo_train_config(agent=agent, scenario=scenario),  # type: ignore[arg-type]
    )
    config.train = with_explicit_settings(config.train)
    summary = run_demo(get_settings(), config, progress=typer.echo)
    if not summary.proven:
        raise typer.Exit(code=2)


def main() -> None:
    """Entry point: clear one-line errors instead of stack traces for known failures."""
    try:
        cli()
    except (
        SettingsError,
        ServiceError,
        PublishError,
        ReplicaError,
        CycleBusy,
        BaseModelError,
        TopicDurabilityError,
    ) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
