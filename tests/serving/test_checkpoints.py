"""Publishing, retiring and reconciling checkpoints against a real vLLM server."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from app.db import session_scope
from app.models import Checkpoint, CheckpointStatus
from app.processes import free_port
from app.serving.publish import (
    PublishError,
    ensure_base_checkpoint,
    publish_checkpoint,
    reconcile,
    retire_checkpoint,
)
from app.serving.replicas import load_adapter, served_adapters, unload_adapter
from app.serving.vllm import VllmServer

PROMPT = "def f(x):"


@pytest.fixture
def registry(engine: Engine, tiny_model_dir: Path) -> Engine:
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(tiny_model_dir))
    return engine


def publish(
    engine: Engine, server: VllmServer, adapter: Path, store: Path, **kw: object
) -> Checkpoint:
    return publish_checkpoint(
        engine,
        adapter,
        parent="base",
        replicas=kw.pop("replicas", [server.url]),  # type: ignore[arg-type]
        checkpoints_dir=store,
        base_model="tiny",
    )


def greedy_logprobs(server: VllmServer, model: str) -> list[float]:
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def row(engine: Engine, name: str) -> Checkpoint | None:
    with session_scope(engine) as session:
        found = session.scalar(select(Checkpoint).where(Checkpoint.name == name))
        if found is not None:
            session.expunge(found)
        return found


def test_published_adapter_answers_under_its_immutable_name(
    registry: Engine, vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> None:
    published = publish(registry, vllm_server, lora_dir, tmp_path)

    assert re.fullmatch(r"ckpt-\d+", published.name)
    assert published.status == CheckpointStatus.candidate
    stored = tmp_path / published.name
    assert (stored / "adapter_model.safetensors").is_file()
    assert '"parent": "base"' in (stored / "manifest.json").read_text()
    registered = row(registry, published.name)
    assert registered is not None and registered.adapter_path == str(stored)

    assert greedy_logprobs(vllm_server, published.name) != greedy_logprobs(vllm_server, "base")


def test_a_down_replica_is_named_and_nothing_is_registered(
    registry: Engine, vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PublishError, match=re.escape(down)) as excinfo:
        publish(registry, vllm_server, lora_dir, tmp_path, replicas=[vllm_server.url, down])
    failed_name = re.search(r"ckpt-\d+", str(excinfo.value))
    assert failed_name is not None
    assert row(registry, failed_name.group()) is None
    assert failed_name.group() not in served_adapters(vllm_server.url)
    assert not (tmp_path / failed_name.group()).exists()

    # The failed attempt's number is burnt: names are never reused.
    after = publish(registry, vllm_server, lora_dir, tmp_path)
    assert int(after.name.split("-")[1]) > int(failed_name.group().split("-")[1])


def test_a_directory_without_an_adapter_is_refused(
    registry: Engine, vllm_server: VllmServer, tmp_path: Path
) -> None:
    with pytest.raises(PublishError, match="not a PEFT adapter"):
        publish(registry, vllm_server, tmp_path, tmp_path / "store")


def test_retired_checkpoints_are_unloaded(
    registry: Engine, vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> None:
    published = publish(registry, vllm_server, lora_dir, tmp_path)
    assert retire_checkpoint(registry, published.name, [vllm_server.url]) == []
    assert published.name not in served_adapters(vllm_server.url)
    retired = row(registry, published.name)
    assert retired is not None and retired.status == CheckpointStatus.retired


@pytest.mark.scenario
@pytest.mark.slow
def test_reconcile_restores_exactly_the_live_checkpoints_after_a_restart(
    clean_registry: Engine, vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> None:
    # A clean registry: whatever earlier tests in this process left live (a canary, a
    # production checkpoint) would rightly be served too.
    published = publish(clean_registry, vllm_server, lora_dir, tmp_path)
    vllm_server.stop()
    vllm_server.start(timeout=300)
    assert served_adapters(vllm_server.url) == {}
    # Something loaded by hand that the registry does not know about.
    load_adapter(vllm_server.url, "ckpt-stray", lora_dir)

    report = reconcile(clean_registry, [vllm_server.url])

    assert set(served_adapters(vllm_server.url)) == {published.name}
    assert report.loaded[vllm_server.url] == [published.name]
    assert report.unloaded[vllm_server.url] == ["ckpt-stray"]
    assert report.errors == []


def test_publishing_reconciling_and_retiring_send_the_vllm_api_key(
    clean_registry: Engine, keyed_vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> None:
    server, key = keyed_vllm_server, keyed_vllm_server.api_key
    with pytest.raises(PublishError, match="rtrl sent no API key"):
        publish(clean_registry, server, lora_dir, tmp_path / "keyless")

    published = publish_checkpoint(
        clean_registry,
        lora_dir,
        parent="base",
        replicas=[server.url],
        checkpoints_dir=tmp_path / "store",
        base_model="tiny",
        api_key=key,
    )
    assert published.name in served_adapters(server.url, api_key=key)

    # As after a restart: the live checkpoint missing, a stray one loaded.
    unload_adapter(server.url, published.name, api_key=key)
    load_adapter(server.url, "ckpt-stray-keyed", lora_dir, api_key=key)
    report = reconcile(clean_registry, [server.url], api_key=key)
    assert report.errors == []
    assert report.loaded[server.url] == [published.name]
    assert report.unloaded[server.url] == ["ckpt-stray-keyed"]

    assert retire_checkpoint(clean_registry, published.name, [server.url], api_key=key) == []
    assert served_adapters(server.url, api_key=key) == {}
