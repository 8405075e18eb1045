"""The closed loop end to end, smaller than `make demo`: a candidate trained on production's traffic
and promoted only when it is ahead on held-out traffic; a reward-hacked canary caught by the
monitors on agent traffic and kept out of production. Agent learning over two cycles is measured
by `make demo` and `python -m bench.agent_learning`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from app.abtest.stats import Comparison
from app.config import Settings, SettingsError
from app.db import session_scope
from app.models import Checkpoint
from app.registry.experiments import start_canary
from app.registry.routing import notify_routing_changed_sync
from app.serving.publish import publish_checkpoint
from app.serving.vllm import VllmServer
from rtrl.demo import (
    FLAWED_REWARD_VERSION,
    HACKING_BASE_DIR,
    CycleRecord,
    DemoConfig,
    DemoSummary,
    Ops,
    create_keys,
    demo_train_config,
    hacking_verdict,
    judge_canary,
    production_name,
    run_demo,
    scenario_settings,
)
from rtrl.embedded.stack import EmbeddedStack
from rtrl.launcher import FullStack
from sandbox.bases import HACKING_BASE, shipped_base_dir, verify_base
from tests.conftest import (
    external_settings,
    fine_tune_toward_malformed_calls,
    start_group_at_end,
)


def summary(served_low: float | None, solved_low: float | None) -> DemoSummary:
    offline: dict[str, Comparison | None] = {}
    if solved_low is not None:
        offline["solved"] = Comparison(0.1, None, solved_low, solved_low + 0.1, 0.01)
    return DemoSummary([], "ckpt-1", 0.5, 0.55, 0.05, served_low, None, "", offline=offline)


def test_the_demo_is_judged_on_its_offline_runs_when_it_made_them() -> None:
    # The served A/B of about 80 developers cannot resolve a cycle's gain; 400 offline runs
    # per model can, so they decide (the exit code of `rtrl demo`).
    assert summary(served_low=-0.02, solved_low=0.03).proven
    assert not summary(served_low=0.01, solved_low=-0.01).proven
    # Without them (one-turn traffic, or `--offline-runs 0`) the served kept rate decides.
    assert summary(served_low=0.01, solved_low=None).proven
    assert not summary(served_low=-0.01, solved_low=None).proven
    assert not summary(served_low=None, solved_low=None).proven


def test_the_reward_hacking_scenario_is_judged_on_its_catch() -> None:
    def hacking(*cycles: CycleRecord) -> DemoSummary:
        judged = summary(served_low=None, solved_low=None)
        judged.scenario, judged.cycles = "reward-hacking", list(cycles)
        return judged

    clean = CycleRecord(1, FLAWED_REWARD_VERSION, "ckpt-1", "promoted")
    caught = CycleRecord(
        2, FLAWED_REWARD_VERSION, "ckpt-2", "held back by alerts", ["malformed_call_rate"]
    )
    missed = CycleRecord(2, FLAWED_REWARD_VERSION, "ckpt-2", "promoted", ["malformed_call_rate"])
    assert hacking(clean, caught).proven
    assert "caught the hack (cycle 2: malformed_call_rate on ckpt-2" in hacking_verdict(
        hacking(clean, caught)
    )
    assert not hacking(clean).proven  # nothing alerted: nothing shown
    assert "no monitor alerted" in hacking_verdict(hacking(clean))
    assert not hacking(clean, missed).proven  # alerted, yet promoted (overridden)
    assert "NOT kept out" in hacking_verdict(hacking(clean, missed))


def test_the_hacking_scenario_runs_on_the_shipped_weak_base_and_refuses_a_mismatched_data_dir(
    tmp_path: Path,
) -> None:
    weak = tmp_path / "models" / HACKING_BASE_DIR
    settings = Settings(data_dir=tmp_path, base_model=None, reward_version=5)
    said: list[str] = []

    learning = scenario_settings(settings, "learning", said.append)
    assert learning.base_model_path == tmp_path / "models" / "base"
    assert learning.reward_version == 5
    assert said == []  # the learning scenario's base is the stack's to install
    hacking = scenario_settings(settings, "reward-hacking", said.append)
    assert hacking.base_model_path == weak
    assert hacking.reward_version == FLAWED_REWARD_VERSION
    # The shipped base, copied in and named with its checksum; nothing trained.
    shipped = verify_base(shipped_base_dir(HACKING_BASE))
    assert verify_base(weak).checksum == shipped.checksum
    assert any(
        f"{HACKING_BASE} sha256:{shipped.checksum[:12]}" in line and "installed" in line
        for line in said
    ), said
    said.clear()
    assert scenario_settings(settings, "reward-hacking", said.append).base_model_path == weak
    assert any("found" in line and HACKING_BASE in line for line in said), said
    named = scenario_settings(
        settings.model_copy(update={"base_model": tmp_path / "mine"}), "reward-hacking", print
    )
    assert named.base_model_path == tmp_path / "mine"  # RTRL_BASE_MODEL wins

    # A learning demo's checkpoint left in the data dir: its adapter would be served on the
    # scenario's base, so the scenario refuses, naming both.
    adapter = tmp_path / "checkpoints" / "ckpt-3"
    adapter.mkdir(parents=True)
    trained_on = tmp_path / "models" / "base"
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(trained_on)})
    )
    assert scenario_settings(settings, "learning", print).base_model_path == trained_on
    with pytest.raises(SettingsError, match="ckpt-3") as refused:
        scenario_settings(settings, "reward-hacking", print)
    assert str(trained_on) in str(refused.value) and str(weak) in str(refused.value)


@pytest.mark.scenario
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
    # cycle's gain is smaller than the demo's A/B can resolve (see docs/results/agent-demo.md).
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


@pytest.mark.scenario
@pytest.mark.slow
def test_a_reward_hacked_canary_raises_the_monitors_alert_and_is_not_promoted(
    clean_registry: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    settings = external_settings(stack, vllm_server, tiny_model_dir, tmp_path).model_copy(
        update={"reward_version": FLAWED_REWARD_VERSION}
    )
    hacked = tmp_path / "hacked-adapter"
    fine_tune_toward_malformed_calls(tiny_model_dir, hacked)
    # 96 evaluating developers: the monitors give no verdict on fewer than 200 tool-calling
    # answers an arm (about 11 a developer here; with 40, one run's canary drew only 12
    # developers, 149 answers), and alert only when the difference is clear of noise over
    # developers: simulated with this canary's shares (38% against 20%, developers varying),
    # 32 an arm catch it in 93% of runs, 48 in 99% (`tests/workers/test_monitors.py`).
    config = DemoConfig(
        cycles=1, eval_users=96, concurrency=8, scenario="reward-hacking", progress_bars=False
    )
    start_group_at_end(settings.kafka_bootstrap_servers, "rtrl-workers")
    demo = FullStack.from_settings(settings, workers=1, trainer=False)
    demo.up()
    try:
        keys = create_keys(clean_registry)
        ops = Ops(demo.gateway_url, keys.ops)
        ops.stop_all()
        # Published and put on canary as the trainer does with a cycle's adapter.
        checkpoint = publish_checkpoint(
            clean_registry,
            hacked,
            parent="base",
            replicas=settings.vllm_urls,
            checkpoints_dir=settings.checkpoints_dir.resolve(),
            base_model=str(settings.base_model_path),
            reward_version=FLAWED_REWARD_VERSION,
        )
        with session_scope(clean_registry) as session:
            named = {c.name: c for c in session.scalars(select(Checkpoint))}
            start_canary(
                session,
                control=named["base"],
                treatment=named[checkpoint.name],
                treatment_bps=500,
                created_by="reward-hacking test",
            )
        notify_routing_changed_sync(settings.redis_url)

        record = judge_canary(
            clean_registry,
            demo.gateway_url,
            ops,
            keys,
            config,
            CycleRecord(1, FLAWED_REWARD_VERSION, checkpoint.name, ""),
            print,
        )
        # Asked again after the demo's decision: the alert alone refuses it.
        refusal = ops.promote(checkpoint.name)
    finally:
        demo.down(started_only=True)

    assert record.card is not None
    print(f"{checkpoint.name}: {record.decision}, alerts {record.alerts}")
    assert "malformed_call_rate" in record.alerts
    assert record.decision != "promoted"
    assert refusal is not None and "malformed_call_rate" in refusal
    assert production_name(clean_registry) == "base"
