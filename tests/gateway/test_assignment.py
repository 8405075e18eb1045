"""A/B assignment: deterministic buckets, sticky arms across gateways and ramps, fallbacks,
live changes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.abtest.assignment import (
    ArmRoute,
    ExperimentRoute,
    RoutingTable,
    bucket_bps,
    fnv1a32,
    hash_user,
    load_routing_table,
)
from app.config import Settings
from app.db import make_async_engine, session_scope
from app.events import COMPLETIONS_TOPIC
from app.models import Arm, Checkpoint, CheckpointStatus, Experiment, ExperimentStatus
from app.registry.audit import Actor, RegistryError
from app.registry.buckets import ArmWeight, arm_ranges, check_layout
from app.registry.experiments import create_experiment, ramp_experiment, stop_experiment
from app.registry.routing import ROUTING_CHANNEL
from app.registry.schemas import ExperimentCreate
from app.serving.publish import publish_checkpoint, retire_checkpoint
from app.serving.vllm import VllmServer


def test_fnv1a32_matches_the_reference_vectors() -> None:
    assert fnv1a32("") == 0x811C9DC5
    assert fnv1a32("a") == 0xE40C292C
    assert fnv1a32("foobar") == 0xBF9CF968


def test_buckets_are_growthbook_v2_and_evenly_spread() -> None:
    assert bucket_bps("salt", "user") == fnv1a32(str(fnv1a32("saltuser"))) % 10_000
    buckets = [bucket_bps("exp-1", hash_user("k", f"user-{n}")) for n in range(10_000)]
    assert all(0 <= b < 10_000 for b in buckets)
    assert 0.47 < sum(b < 5_000 for b in buckets) / len(buckets) < 0.53
    # Another salt reshuffles users independently of the first experiment.
    other = [bucket_bps("exp-2", hash_user("k", f"user-{n}")) for n in range(10_000)]
    same_half = sum((a < 5_000) == (b < 5_000) for a, b in zip(buckets, other, strict=True))
    assert 0.47 < same_half / len(buckets) < 0.53


def test_the_routing_table_routes_arms_remainder_and_unserved_checkpoints() -> None:
    arms = (
        ArmRoute("control", "ckpt-1", ((0, 3_000),)),
        ArmRoute("canary", "ckpt-2", ((9_000, 10_000),)),
    )
    table = RoutingTable(production="ckpt-1", experiment=ExperimentRoute(7, "s", arms))
    users = [hash_user("k", f"u{n}") for n in range(2_000)]
    by_bucket = {user: bucket_bps("s", user) for user in users}

    for user, bucket in by_bucket.items():
        assignment = table.assign(user, frozenset({"ckpt-1", "ckpt-2"}))
        if bucket < 3_000:
            assert (assignment.checkpoint, assignment.arm) == ("ckpt-1", "control")
        elif bucket >= 9_000:
            assert (assignment.checkpoint, assignment.arm) == ("ckpt-2", "canary")
        else:
            assert (assignment.checkpoint, assignment.arm, assignment.experiment_id) == (
                "ckpt-1",
                None,
                None,
            )
        unserved = table.assign(user, frozenset({"ckpt-1"}))
        if bucket >= 9_000:
            assert unserved.checkpoint == "ckpt-1" and unserved.fallback
            assert unserved.arm == "canary"
        else:
            assert not unserved.fallback
    assert RoutingTable(production="ckpt-9").assign(users[0]).checkpoint == "ckpt-9"


def test_treatments_grow_downward_from_the_top_and_control_keeps_the_lowest_free_buckets() -> None:
    one = arm_ranges([ArmWeight("control", 9_000, True), ArmWeight("canary", 1_000, False)])
    assert one == {"canary": ((9_000, 10_000),), "control": ((0, 9_000),)}
    two = arm_ranges(
        [
            ArmWeight("control", 6_000, True),
            ArmWeight("a", 1_000, False),
            ArmWeight("b", 3_000, False),
        ]
    )
    assert two == {
        "a": ((9_000, 10_000),),
        "b": ((2_000, 5_000),),
        "control": ((0, 2_000), (5_000, 9_000)),
    }
    with pytest.raises(RegistryError) as refused:
        check_layout(
            [
                ArmWeight("control", 2_000, True),
                ArmWeight("a", 6_000, False),
                ArmWeight("b", 2_000, False),
            ]
        )
    assert refused.value.code == "weight_exceeds_slot"


async def _assignments(engine: Engine, route: str, users: list[str]) -> dict[str, str | None]:
    async_engine = make_async_engine(engine.url.render_as_string(hide_password=False))
    try:
        async with AsyncSession(async_engine) as session:
            table = await load_routing_table(session, route)
    finally:
        await async_engine.dispose()
    return {user: table.assign(user).arm for user in users}


def test_ramping_a_canary_from_10_to_50_percent_moves_no_treatment_user_to_control(
    engine: Engine,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    route = f"ramp-{suffix}"
    with session_scope(engine) as session:
        for name in (f"ramp-base-{suffix}", f"ramp-canary-{suffix}"):
            session.add(Checkpoint(name=name, status=CheckpointStatus.candidate, base_model="tiny"))
        session.flush()
        spec = ExperimentCreate(
            name=f"ramp-{suffix}",
            route=route,
            arms=[
                {
                    "name": "control",
                    "checkpoint": f"ramp-base-{suffix}",
                    "weight_bps": 9_000,
                    "is_control": True,
                },
                {"name": "treatment", "checkpoint": f"ramp-canary-{suffix}", "weight_bps": 1_000},
            ],
            start=True,
        )
        experiment_id = create_experiment(session, spec, Actor("ops")).id
    users = [hash_user("k", f"user-{n}") for n in range(10_000)]

    before = asyncio.run(_assignments(engine, route, users))
    with session_scope(engine) as session:
        ramp_experiment(
            session, experiment_id, {"control": 5_000, "treatment": 5_000}, Actor("ops")
        )
    after = asyncio.run(_assignments(engine, route, users))

    treated_before = {u for u, arm in before.items() if arm == "treatment"}
    treated_after = {u for u, arm in after.items() if arm == "treatment"}
    assert 0.08 < len(treated_before) / len(users) < 0.12
    assert 0.47 < len(treated_after) / len(users) < 0.53
    assert treated_before <= treated_after  # nobody left the treatment
    assert all(after[u] in ("control", "treatment") for u in users)
    moved = [u for u in users if before[u] != after[u]]
    assert moved and all(before[u] == "control" and after[u] == "treatment" for u in moved)

    # Back down would return treated users to control mid-experiment: refused; 0 stops the arm.
    with session_scope(engine) as session, pytest.raises(RegistryError) as refused:
        ramp_experiment(
            session, experiment_id, {"control": 9_000, "treatment": 1_000}, Actor("ops")
        )
    assert refused.value.code == "treatment_weight_lowered"
    with session_scope(engine) as session:
        ramp_experiment(session, experiment_id, {"control": 10_000, "treatment": 0}, Actor("ops"))
        stop_experiment(session, experiment_id, Actor("ops"))
    stopped = asyncio.run(_assignments(engine, route, users[:100]))
    assert set(stopped.values()) == {None}


def users_in_halves(settings: Settings, salt: str) -> tuple[str, str]:
    """One user id bucketed below 5000 and one above, as the gateway will hash them."""
    secret = settings.user_hash_secret.get_secret_value()
    low = high = None
    for n in range(1_000):
        user = f"user-{n}"
        if bucket_bps(salt, hash_user(secret, user)) < 5_000:
            low = low or user
        else:
            high = high or user
        if low and high:
            return low, high
    raise AssertionError("no split found")


@pytest.fixture
def canary(
    registry: Engine, vllm_server: VllmServer, lora_dir: Path, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """A published LoRA checkpoint in a running 50/50 experiment against production."""
    checkpoint = publish_checkpoint(
        registry,
        lora_dir,
        parent="base",
        replicas=[vllm_server.url],
        checkpoints_dir=tmp_path / "checkpoints",
        base_model="tiny",
    )
    salt = uuid.uuid4().hex
    with session_scope(registry) as session:
        production = session.scalar(
            select(Checkpoint).where(Checkpoint.status == CheckpointStatus.production)
        )
        assert production is not None
        candidate = session.scalar(select(Checkpoint).where(Checkpoint.name == checkpoint.name))
        assert candidate is not None
        experiment = Experiment(
            name=f"test-{salt[:8]}",
            salt=salt,
            status=ExperimentStatus.running,
            started_at=datetime.now(UTC),
            arms=[
                Arm(name="control", checkpoint_id=production.id, weight_bps=5_000, is_control=True),
                Arm(name="canary", checkpoint_id=candidate.id, weight_bps=5_000),
            ],
        )
        session.add(experiment)
        session.flush()
        facts = {
            "experiment_id": experiment.id,
            "salt": salt,
            "production": production.name,
            "canary": checkpoint.name,
        }
    try:
        yield facts
    finally:
        with session_scope(registry) as session:
            session.execute(
                update(Experiment)
                .where(Experiment.id == facts["experiment_id"])
                .values(status=ExperimentStatus.stopped, stopped_at=datetime.now(UTC))
            )
        retire_checkpoint(registry, checkpoint.name, [vllm_server.url])


def chat(server: Any, key: str, user: str, request_id: str) -> httpx.Response:
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "rtrl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={
            "Authorization": f"Bearer {key}",
            "X-Session-Id": f"s-{user}",
            "X-Request-Id": request_id,
            "X-User-Id": user,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def test_users_keep_their_arm_across_gateway_restarts(
    canary: dict[str, Any],
    gateway_settings: Settings,
    start_gateway: Any,
    ide_key: str,
    kafka: Any,
) -> None:
    low, high = users_in_halves(gateway_settings, canary["salt"])
    expected = {low: ("control", canary["production"]), high: ("canary", canary["canary"])}
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_ids = set()

    for _restart in range(2):
        gateway = start_gateway(gateway_settings)
        for user, (_arm, checkpoint) in expected.items():
            for _ in range(2):
                request_id = f"r-{uuid.uuid4().hex[:12]}"
                request_ids.add(request_id)
                response = chat(gateway, ide_key, user, request_id)
                assert response.json()["model"] == checkpoint
                assert response.headers["x-rtrl-checkpoint"] == checkpoint
        gateway.stop()

    events = [
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests(request_ids))
        if e["request_id"] in request_ids
    ]
    assert len(events) == len(request_ids) == 8
    for event in events:
        user = event["session_id"].removeprefix("s-")
        arm, checkpoint = expected[user]
        assert (event["arm"], event["checkpoint"]) == (arm, checkpoint)
        assert event["experiment_id"] == canary["experiment_id"] and not event["fallback"]
        assert event["completion_token_ids"] and event["behaviour_logprobs"]


def test_routing_changes_reach_a_running_gateway_through_redis(
    canary: dict[str, Any],
    gateway_server: Any,
    gateway_settings: Settings,
    ide_key: str,
    registry: Engine,
    stack: Any,
) -> None:
    _, high = users_in_halves(gateway_settings, canary["salt"])
    assert (
        chat(gateway_server, ide_key, high, f"r-{uuid.uuid4().hex}").json()["model"]
        == (canary["canary"])
    )
    with session_scope(registry) as session:
        session.execute(
            update(Experiment)
            .where(Experiment.id == canary["experiment_id"])
            .values(status=ExperimentStatus.stopped)
        )
    redis.Redis.from_url(stack.redis.url).publish(ROUTING_CHANNEL, "changed")

    deadline = time.monotonic() + 5
    while (
        chat(gateway_server, ide_key, high, f"r-{uuid.uuid4().hex}").json()["model"]
        != (canary["production"])
    ):
        assert time.monotonic() < deadline, "the gateway did not hear the routing change"
        time.sleep(0.1)


def test_an_arm_whose_checkpoint_is_not_served_falls_back_to_production(
    canary: dict[str, Any],
    gateway_server: Any,
    gateway_settings: Settings,
    ide_key: str,
    kafka: Any,
    vllm_server: VllmServer,
) -> None:
    _, high = users_in_halves(gateway_settings, canary["salt"])
    # Unloaded behind the registry's back, e.g. a replica restarted without reconciling.
    httpx.post(
        f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": canary["canary"]}
    ).raise_for_status()
    since = kafka.end_offsets(COMPLETIONS_TOPIC)
    request_id = f"r-{uuid.uuid4().hex[:12]}"

    response = chat(gateway_server, ide_key, high, request_id)

    assert response.json()["model"] == canary["production"]
    event = next(
        e
        for e in kafka.read(COMPLETIONS_TOPIC, since, until=kafka.for_requests({request_id}))
        if e["request_id"] == request_id
    )
    assert event["fallback"] is True and event["arm"] == "canary"
    assert event["checkpoint"] == canary["production"]
    metrics = httpx.get(f"{gateway_server.url}/metrics").text
    assert f'rtrl_routing_fallbacks_total{{checkpoint="{canary["canary"]}"}}' in metrics
