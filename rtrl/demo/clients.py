"""The demo's keys and what it asks the product over HTTP: the operator's changes through
`/admin`, the analyst's reads from `/analytics`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import Engine

from app.abtest.rollups import refresh_rollups
from app.auth.service import new_api_key
from app.db import session_scope
from app.models import Role


@dataclass
class DemoKeys:
    ide: str
    evaluator: str
    analyst: str
    ops: str


def create_keys(engine: Engine) -> DemoKeys:
    """Fresh keys for the demo's developers, evaluators, analyst and operator."""
    secrets: dict[str, str] = {}
    with session_scope(engine) as session:
        for label, role, privacy in (
            ("ide", Role.ide, False),
            ("evaluator", Role.ide, True),
            ("analyst", Role.analyst, False),
            ("ops", Role.ops, False),
        ):
            row, secret = new_api_key(
                name=f"demo-{label}",
                role=role,
                privacy_mode=privacy,
                # A whole simulated population shares each key.
                rate_limit_per_minute=100_000,
                created_by="rtrl demo",
            )
            session.add(row)
            secrets[label] = secret
    return DemoKeys(**secrets)


class Ops:
    """The operator's side of the demo: every change goes through `/admin`, audited."""

    def __init__(self, gateway_url: str, key: str) -> None:
        self.client = httpx.Client(
            base_url=f"{gateway_url}/admin",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )

    def _post(self, path: str, body: object = None) -> Any:
        response = self.client.post(path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"POST /admin{path}: {response.status_code} {response.text}")
        return response.json()

    def running_experiments(self) -> list[dict[str, Any]]:
        response = self.client.get("/experiments", params={"status": "running"})
        response.raise_for_status()
        experiments: list[dict[str, Any]] = response.json()
        return experiments

    def stop_all(self) -> None:
        for experiment in self.running_experiments():
            self._post(f"/experiments/{experiment['id']}/stop", {"reason": "rtrl demo"})

    def ramp(self, experiment_id: int, weights: dict[str, int]) -> None:
        self._post(f"/experiments/{experiment_id}/ramp", {"weights": weights})

    def promote(self, name: str) -> str | None:
        """Promote `name`; the refusal's message when the monitors' alerts hold it back."""
        response = self.client.post(
            f"/checkpoints/{name}/promote", json={"reason": "won its A/B test"}
        )
        if response.status_code == 409 and "monitor_alerts" in response.text:
            message: str = response.json()["error"]["message"]
            return message
        if response.status_code >= 400:
            raise RuntimeError(f"POST /admin/checkpoints/{name}/promote: {response.text}")
        return None

    def roll_back(self, name: str) -> None:
        self._post(f"/checkpoints/{name}/rollback", {"reason": "did not win its A/B test"})


def analytics(gateway_url: str, analyst_key: str, path: str) -> dict[str, Any]:
    """One analyst's read from `/analytics{path}`."""
    response = httpx.get(
        f"{gateway_url}/analytics{path}",
        headers={"Authorization": f"Bearer {analyst_key}"},
        timeout=60,
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def results(
    engine: Engine, gateway_url: str, analyst_key: str, experiment_id: int
) -> dict[str, Any]:
    """The experiment's A/B results from `/analytics`, with the rollups brought up to date."""
    # Analytics reads hourly rollups refreshed at most every 30 s; the demo asks seconds
    # after the traffic it wants to see, so it refreshes them first.
    refresh_rollups(engine)
    return analytics(gateway_url, analyst_key, f"/experiments/{experiment_id}/results")


def predictions(gateway_url: str, analyst_key: str) -> dict[str, Any]:
    """The scoreboard of predicted against realized A/Bs, from `/analytics/predictions`."""
    return analytics(gateway_url, analyst_key, "/predictions")


def treatment_kept(body: dict[str, Any]) -> dict[str, Any]:
    """The treatment arm's kept rate in `/analytics` results, with its difference from
    control."""
    arm = next(a for a in body["arms"] if not a["is_control"])
    kept: dict[str, Any] = arm["metrics"]["kept"]
    return kept
