"""`rtrl backup`: a running loop is backed up, its database is lost, and a restore into a new
one keeps the books, the production checkpoint and its adapter, and every erasure made after
the backup."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select, text

from app.config import settings_environment
from app.db import make_engine, session_scope
from app.gateway.upstream import SERVED_MODELS_TTL_S
from app.models import Checkpoint, CheckpointStatus, Role, Sample
from app.processes import free_port
from app.registry.audit import Actor
from app.registry.checkpoints import promote
from app.registry.routing import notify_routing_changed_sync
from app.serving.publish import publish_checkpoint
from app.serving.replicas import unload_adapter
from app.serving.vllm import VllmServer
from rtrl.backup import file_sha256
from rtrl.embedded.postgres import EmbeddedPostgres
from rtrl.embedded.stack import EmbeddedStack
from sandbox.simulator.books import read_books
from tests.reliability.conftest import Loop, make_key, open_loop

pytestmark = pytest.mark.slow


def rtrl(environment: dict[str, str], *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rtrl.cli", *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def adapter_sums(directory: Path) -> dict[str, str]:
    return {
        path.relative_to(directory).as_posix(): file_sha256(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def loop(
    clean_registry: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> Iterator[Loop]:
    """A clean registry, a running gateway and one worker over the session's services."""
    loop = open_loop(clean_registry, stack, vllm_server, tiny_model_dir, tmp_path / "loop")
    try:
        yield loop
    finally:
        loop.stop()


@pytest.fixture
def new_database(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """The database of a host that lost its disk: a new, empty Postgres cluster."""
    postgres = EmbeddedPostgres(tmp_path / "new-postgres", free_port())
    postgres.start()
    try:
        yield postgres
    finally:
        postgres.stop()


@pytest.mark.scenario
def test_a_restore_into_a_new_database_keeps_the_books_production_and_later_erasures(
    loop: Loop,
    lora_dir: Path,
    new_database: EmbeddedPostgres,
    tmp_path: Path,
) -> None:
    engine, settings = loop.engine, loop.settings
    environment = settings_environment(settings)
    checkpoint = publish_checkpoint(
        engine,
        lora_dir,
        parent="base",
        replicas=settings.vllm_urls,
        checkpoints_dir=settings.checkpoints_dir,
        base_model=str(settings.base_model),
    )
    try:
        with session_scope(engine) as session:
            promote(session, checkpoint.name, Actor("backup test"))
        notify_routing_changed_sync(settings.redis_url)
        time.sleep(SERVED_MODELS_TTL_S + 1)  # the gateway's list of served models has it
        served = loop.traffic(users=4, seed=21).result()
        assert loop.wait_for_books([served]).balanced
        assert {request.checkpoint for request in served.served} == {checkpoint.name}

        backup = tmp_path / "backups" / "first"
        created = rtrl(environment, "backup", "create", str(backup))
        assert created.returncode == 0, created.stderr
        print(created.stdout)

        # After the backup: a user is erased, and the erasure log kept outside the database.
        erased_user = served.served[0].user_id
        ops_key = make_key(engine, Role.ops)
        erased = httpx.post(
            f"{loop.url}/admin/users/erase",
            json={"user_id": erased_user, "reason": "asked to be forgotten"},
            headers={"Authorization": f"Bearer {ops_key}"},
            timeout=30,
        )
        assert erased.status_code == 200, erased.text
        user_hash = erased.json()["user_hash"]
        erasure_log = tmp_path / "off-site" / "erasures.jsonl"
        exported = rtrl(environment, "backup", "erasures", str(erasure_log))
        assert exported.returncode == 0, exported.stderr
    finally:
        unload_adapter(settings.vllm_urls[0], checkpoint.name)

    # The database and the data volume are lost; restore on a host with new, empty ones.
    restored_data = tmp_path / "restored-data"
    restore_environment = environment | {
        "RTRL_DATABASE_URL": new_database.url,
        "RTRL_DATA_DIR": str(restored_data),
    }
    assert rtrl(restore_environment, "backup", "restore", str(backup)).returncode == 2
    restored = rtrl(
        restore_environment, "backup", "restore", str(backup), "--erasure-log", str(erasure_log)
    )
    assert restored.returncode == 0, restored.stderr
    print(restored.stdout)
    assert "erased again 1 users erased after the backup" in restored.stdout

    restored_engine = make_engine(new_database.url)
    try:
        # The books balance for everyone not erased: every completion has its one sample and
        # one final reward with the developer's verdict, and the same feedback is stored.
        kept = dataclasses.replace(
            served, served=[r for r in served.served if r.user_id != erased_user]
        )
        assert len(kept.served) < len(served.served)
        books = read_books(restored_engine, [kept])
        assert not (books.missing_samples or books.unfinalized or books.orphans), books
        assert not books.wrong_verdicts and books.samples == books.served == len(kept.served)
        assert books == read_books(engine, [kept])
        with restored_engine.connect() as conn:
            assert (
                conn.execute(
                    text(
                        "SELECT count(*) FROM samples s WHERE (SELECT count(*) FROM rewards r"
                        " WHERE r.sample_id = s.id AND r.served_at = s.served_at) <> 1"
                    )
                ).scalar_one()
                == 0
            )
            # The user erased after the backup is erased again, as of the same moment.
            assert conn.execute(select(Sample.id).where(Sample.user_hash == user_hash)).all() == []
            again = conn.execute(
                text("SELECT erased_at FROM erased_users WHERE user_hash = :h"), {"h": user_hash}
            ).scalar_one()
        with engine.connect() as conn:
            assert (
                again
                == conn.execute(
                    text("SELECT erased_at FROM erased_users WHERE user_hash = :h"),
                    {"h": user_hash},
                ).scalar_one()
            )

        # Production is the same checkpoint, its adapter in the new data dir, file for file.
        with session_scope(restored_engine) as session:
            production = session.scalar(
                select(Checkpoint).where(Checkpoint.status == CheckpointStatus.production)
            )
            assert production is not None and production.name == checkpoint.name
            assert production.adapter_path is not None
            restored_adapter = Path(production.adapter_path)
        assert restored_adapter == (restored_data / "checkpoints" / checkpoint.name).resolve()
        assert checkpoint.adapter_path is not None
        assert adapter_sums(restored_adapter) == adapter_sums(Path(checkpoint.adapter_path))
        assert set(adapter_sums(restored_adapter)) >= {
            "adapter_config.json",
            "adapter_model.safetensors",
        }

        # A restore never lands on a database that holds anything.
        again_into = rtrl(
            restore_environment, "backup", "restore", str(backup), "--erasure-log", str(erasure_log)
        )
        assert again_into.returncode == 1 and "is not empty" in again_into.stderr
        # Applying the log again (as after a restore by other means) finds nothing to do.
        reapplied = rtrl(restore_environment, "backup", "apply-erasures", str(erasure_log))
        assert reapplied.returncode == 0 and "erased again 0 users" in reapplied.stdout
    finally:
        restored_engine.dispose()

    # A backup that lost a file of an adapter its registry names is refused before anything.
    damaged = tmp_path / "backups" / "damaged"
    shutil.copytree(backup, damaged)
    (damaged / "checkpoints" / checkpoint.name / "adapter_model.safetensors").unlink()
    refused = rtrl(environment, "backup", "verify", str(damaged))
    assert refused.returncode == 1
    assert f"checkpoints/{checkpoint.name}/adapter_model.safetensors is missing" in refused.stderr
    assert rtrl(environment, "backup", "verify", str(backup)).returncode == 0
