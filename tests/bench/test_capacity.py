"""bench.capacity's model: the hardware it prints grows with the traffic as ops expect."""

from __future__ import annotations

import dataclasses

import pytest

from bench.capacity import Assumptions, Measured, plan

MEASURED = Measured(
    completions=1000,
    feedback=5000,
    table_bytes={"samples": 18_000_000, "rewards": 1_300_000, "feedback_events": 1_600_000},
    worker_cpu_s=(0.001, 0.0001),
    postgres_cpu_s=(0.001, 0.00003),
    worker_events_per_s=800.0,
    completion_event_bytes=30_000.0,
    feedback_event_bytes=230.0,
)
ASSUME = Assumptions(
    peak_to_mean=3.0,
    retention_days=30,
    kafka_retention_days=3,
    replica_tokens_per_s=2500.0,
    gateway_cpu_ms=3.5,
    gateway_cpu_ms_per_token=0.1,
    partition_mb_per_s=5.0,
    utilisation=0.6,
    prompt_tokens=2000,
    completion_tokens=300,
)


def test_the_plan_scales_with_the_requests_a_day() -> None:
    small, large = plan(1_000_000, MEASURED, ASSUME), plan(100_000_000, MEASURED, ASSUME)

    # 100 M a day at 3x peak: 3,472 completions/s, each 300 generated tokens.
    assert large.peak_completions_per_s == pytest.approx(100e6 / 86_400 * 3)
    assert large.peak_events_per_s == pytest.approx(large.peak_completions_per_s * 6)
    assert large.vllm_replicas == 695  # ceil(3472 * 300 / (2500 * 0.6))
    assert large.worker_processes == 9  # ceil(3472 * 1.5 ms of worker CPU / 0.6)
    # Each completion streamed token by token: 3.5 ms + 300 tokens * 0.1 ms of gateway CPU.
    assert large.gateway_processes == 194  # ceil(3472 * 33.5 ms / 0.6)
    assert large.postgres_bytes_per_day == pytest.approx(100e6 * 20_900)
    assert large.postgres_bytes_retained == pytest.approx(30 * large.postgres_bytes_per_day)
    for sized in (small, large):
        # Partitions bound the workers of a group, with room to double them.
        assert sized.kafka_partitions >= 2 * sized.worker_processes
        assert sized.kafka_partitions & (sized.kafka_partitions - 1) == 0
    assert large.postgres_bytes_per_day == pytest.approx(100 * small.postgres_bytes_per_day)


def test_gateways_are_sized_by_the_tokens_they_relay() -> None:
    short = plan(100_000_000, MEASURED, dataclasses.replace(ASSUME, completion_tokens=100))
    long = plan(100_000_000, MEASURED, dataclasses.replace(ASSUME, completion_tokens=1000))

    # Every streamed token is a chunk the gateway relays: 13.5 ms against 103.5 ms of CPU.
    assert short.gateway_processes == 79  # ceil(3472 * 13.5 ms / 0.6)
    assert long.gateway_processes == 599  # ceil(3472 * 103.5 ms / 0.6)
