"""Talking to vLLM replicas about LoRA adapters: list, load, unload, serve everywhere."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import httpx


class ReplicaError(RuntimeError):
    """A replica could not be reached or refused a request; the message names it."""

    def __init__(self, replica: str, message: str) -> None:
        super().__init__(f"vLLM replica {replica}: {message}")
        self.replica = replica


def vllm_headers(api_key: str) -> dict[str, str]:
    """What every call to a vLLM server started with `--api-key` carries; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def refused_key(replica: str, api_key: str) -> ReplicaError:
    """The error of a 401: the key rtrl sent (RTRL_VLLM_API_KEY) is not the replica's."""
    sent = "a key that is not its --api-key" if api_key else "no API key"
    return ReplicaError(replica, f"refused the request: rtrl sent {sent} (RTRL_VLLM_API_KEY)")


def _request(
    replica: str,
    method: str,
    path: str,
    *,
    json: object = None,
    timeout: float = 60.0,
    api_key: str = "",
) -> httpx.Response:
    try:
        response = httpx.request(
            method, f"{replica}{path}", json=json, timeout=timeout, headers=vllm_headers(api_key)
        )
    except httpx.HTTPError as exc:
        raise ReplicaError(replica, f"unreachable ({exc.__class__.__name__}: {exc})") from exc
    if response.status_code == 401:
        raise refused_key(replica, api_key)
    return response


def model_entries(
    replica: str, *, timeout: float = 10.0, api_key: str = ""
) -> list[dict[str, object]]:
    """The replica's `/v1/models` entries: the base model and every loaded adapter."""
    response = _request(replica, "GET", "/v1/models", timeout=timeout, api_key=api_key)
    if response.status_code != 200:
        raise ReplicaError(replica, f"GET /v1/models answered {response.status_code}")
    entries: list[dict[str, object]] = response.json().get("data", [])
    return entries


def served_models(replica: str, *, timeout: float = 10.0, api_key: str = "") -> list[str]:
    """Every model name the replica answers to (base and adapters)."""
    entries = model_entries(replica, timeout=timeout, api_key=api_key)
    return [str(entry["id"]) for entry in entries]


def served_adapters(replica: str, *, api_key: str = "") -> dict[str, str]:
    """LoRA adapters the replica serves now: name → path it loaded them from."""
    return {
        str(entry["id"]): str(entry.get("root", ""))
        for entry in model_entries(replica, api_key=api_key)
        if entry.get("parent")
    }


def load_adapter(replica: str, name: str, path: Path, *, api_key: str = "") -> None:
    """Load the adapter at `path` as model `name`, then check /v1/models lists it."""
    response = _request(
        replica,
        "POST",
        "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        api_key=api_key,
    )
    if response.status_code != 200:
        raise ReplicaError(replica, f"loading {name} failed: {response.text.strip()[:500]}")
    if name not in served_adapters(replica, api_key=api_key):
        raise ReplicaError(replica, f"loaded {name} but /v1/models does not list it")


def unload_adapter(replica: str, name: str, *, api_key: str = "") -> None:
    """Stop serving adapter `name`; unloading one that is not loaded is not an error."""
    response = _request(
        replica, "POST", "/v1/unload_lora_adapter", json={"lora_name": name}, api_key=api_key
    )
    if response.status_code != 200 and name in served_adapters(replica, api_key=api_key):
        raise ReplicaError(replica, f"unloading {name} failed: {response.text.strip()[:500]}")


def serve_everywhere(
    name: str, adapter_path: str | None, replicas: Sequence[str], *, api_key: str = ""
) -> list[str]:
    """Load the adapter into every replica that lacks it; the failures, one line each.

    Blocking HTTP: call it from a worker thread.
    """
    if adapter_path is None:
        return []  # the base model is always served
    failures = []
    for replica in replicas:
        try:
            if name not in served_adapters(replica, api_key=api_key):
                load_adapter(replica, name, Path(adapter_path), api_key=api_key)
        except ReplicaError as exc:
            failures.append(str(exc))
    return failures
