"""The closed loop end to end, smaller than `make demo`: a candidate trained on production's traffic
and promoted only when it is ahead on held-out traffic."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.demo import DemoConfig, demo_train_config, run_demo
from app.embedded.stack import EmbeddedStack
from app.serving.vllm import VllmServer
from tests.conftest import external_settings, start_group_at_end


@pytest.mark.slow
def test_one_cycle_trains_a_candidate_and_promotes_it_only_when_it_is_ahead(
    clean_registry: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    # The session's services and vLLM, addressed as external ones: the demo starts only the
    # gateway and a worker, and stops only those. One-turn traffic: on agent traffic one
    # cycle's gain is smaller than the demo's A/B can resolve (see the README's agent demo).
    settings = external_settings(stack, vllm_server, tiny_model_dir, tmp_path)
    # One cycle on 16 developers' traffic is too noisy on this base model for its gain to be
    # asserted (it measured +13.2 pp and -0.9 pp in two runs; tests/trainer/test_cycle.py
    # asserts the learning): this asserts the loop — a candidate trained on production's
    # traffic, evaluated on held-out traffic, and promoted exactly when it is ahead.
    config = DemoConfig(
        cycles=1,
        train_users=16,
        train_sessions=2,
        eval_users=48,
        concurrency=8,
        agent=False,
        progress_bars=False,
        train=demo_train_config(agent=False),
    )

    # The demo's worker joins the product's default group: it starts at the topics' ends,
    # with the demo's own traffic, not behind the session's earlier tests' events.
    start_group_at_end(settings.kafka_bootstrap_servers, "rtrl-workers")
    summary = run_demo(settings, config, progress=print)

    [record] = summary.cycles
    assert record.candidate is not None and record.candidate.startswith("ckpt-")
    difference = record.ab["kept"]["vs_control"]["difference"]
    print(f"{record.candidate}: kept {difference * 100:+.1f} pp against base, {record.decision}")
    if difference > 0 and not record.alerts:
        assert record.decision == "promoted"
        assert summary.final_checkpoint == record.candidate
        assert summary.base_kept is not None and summary.final_kept is not None
        assert summary.ci_low is not None and summary.ci_high is not None
    else:
        assert record.decision != "promoted"
        assert summary.final_checkpoint == "base"
    # The demo stopped the gateway and worker it started, and left the session's stack up.
    assert os.path.exists(tmp_path / "logs" / "gateway.log")
