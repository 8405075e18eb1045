"""`rtrl demo`: the closed loop on this machine, shown end to end.

Simulated developers use production through the gateway — by default as agent sessions:
tools declared, each task a run of tool calls in a workspace — and workers turn what they
did into rewards; a training cycle publishes a canary; the canary is evaluated on held-out
tasks by privacy-mode traffic (which is never trained on), read from `/analytics` and the
reward-hacking monitors, and promoted when it wins and no monitor alerts on it. The summary
compares the last checkpoint with the base model on held-out traffic.

`--scenario reward-hacking` starts the workers on the flawed reward formula 0 (a malformed
call costs nothing, a clarifying question scores above a failed edit), shows the monitors
catching what it teaches and keeping that checkpoint out of production, then fixes the
reward (the latest formula, replayed over history with `rtrl rewards recompute`) and trains
again.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, select

from app.config import Settings
from app.db import make_engine, session_scope
from app.models import Alert, Checkpoint, CheckpointStatus
from app.registry.routing import notify_routing_changed_sync
from app.signals.rewards import LATEST_REWARD_VERSION
from rtrl.demo.clients import DemoKeys, Ops, create_keys, predictions, results, treatment_kept
from rtrl.demo.comparison import final_comparison
from rtrl.demo.config import (
    FLAWED_REWARD_VERSION,
    SEED_STRIDE,
    DemoConfig,
    Progress,
    scenario_settings,
)
from rtrl.demo.records import CycleRecord, DemoSummary
from rtrl.demo.tables import ab_table, cycle_table, hacking_verdict, prediction_table
from rtrl.demo.traffic import held_out_evaluation, rewarded_traffic
from rtrl.gates import held_out_for
from rtrl.launcher import FullStack
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.run import compressed_time_settings
from sandbox.simulator.scorecard import Scorecard, scorecard_table, scorecards
from trainer.cycle import run_cycle
from workers.monitors import check_running_experiments
from workers.sweep import recompute_rewards

BASE = "base"
"""The checkpoint every demo starts from, and the final comparison's control."""


def run_demo(settings: Settings, config: DemoConfig, progress: Progress = print) -> DemoSummary:
    """Start the stack, run the cycles, print the A/B tables and the final summary."""
    started = time.monotonic()
    settings = compressed_time_settings(
        scenario_settings(settings, config.scenario, progress, bootstrap=config.bootstrap_base),
        config.time_scale,
    )
    stack = FullStack.from_settings(
        settings, workers=1, trainer=False, progress=progress, bootstrap=config.bootstrap_base
    )
    stack.up()
    engine = make_engine(settings.database_url)
    try:
        keys = create_keys(engine)
        ops = Ops(stack.gateway_url, keys.ops)
        ops.stop_all()
        records, lineage = run_cycles(engine, settings, stack, ops, keys, config, progress)
        summary = summarize(engine, settings, stack, ops, keys, config, records, lineage, progress)
        progress(f"demo finished in {(time.monotonic() - started) / 60:.1f} min")
        return summary
    finally:
        engine.dispose()
        if not config.keep_running:
            progress("stopping what the demo started ...")
            stack.down(started_only=True)


def run_cycles(
    engine: Engine,
    settings: Settings,
    stack: FullStack,
    ops: Ops,
    keys: DemoKeys,
    config: DemoConfig,
    progress: Progress,
) -> tuple[list[CycleRecord], list[str]]:
    """The training cycles, one after another: their records, and the lineage of production
    (base, then each promoted candidate). The reward-hacking scenario fixes the reward after
    the first cycle the monitors alerted on."""
    hacking = config.scenario == "reward-hacking"
    lineage = [production_name(engine)]
    records: list[CycleRecord] = []
    if hacking:
        progress(
            f"\nreward formula {FLAWED_REWARD_VERSION} (flawed on purpose): a malformed tool"
            " call costs nothing, a clarifying question scores 0.5, above a failed edit (-0.5)"
        )
    for cycle in range(1, config.cycles + 1):
        if (
            hacking
            and records
            and records[-1].alerts
            and settings.reward_version != LATEST_REWARD_VERSION
        ):
            settings = fix_reward(engine, stack, settings, LATEST_REWARD_VERSION, progress)
        record = run_one_cycle(engine, settings, stack, ops, keys, config, cycle, progress)
        records.append(record)
        if record.decision == "promoted" and record.candidate:
            lineage.append(record.candidate)
    return records, lineage


def summarize(
    engine: Engine,
    settings: Settings,
    stack: FullStack,
    ops: Ops,
    keys: DemoKeys,
    config: DemoConfig,
    records: list[CycleRecord],
    lineage: list[str],
    progress: Progress,
) -> DemoSummary:
    """The run's summary, printed: the final comparison (the learning scenario's evidence),
    the cycles' table, the predictions' scoreboard, the reward-hacking verdict, the lineage
    and where the dashboard is."""
    gateway = stack.gateway_url
    final = production_name(engine)
    if config.scenario == "reward-hacking":
        # The scenario's evidence is its cycles: the alert, the refusal, the fixed cycle.
        summary = DemoSummary([], final, None, None, None, None, None, f"{gateway}/dashboard")
    else:
        summary = final_comparison(
            engine, settings, ops, config, keys, gateway, BASE, final, progress
        )
    progress("\n" + cycle_table(records))
    scoreboard = predictions(gateway, keys.analyst)
    progress("\n" + prediction_table(scoreboard))
    summary = replace(
        summary,
        checkpoints=lineage,
        cycles=records,
        scenario=config.scenario,
        predictions=scoreboard,
    )
    if config.scenario == "reward-hacking":
        progress(hacking_verdict(summary))
    progress(f"\nlineage: {' -> '.join(lineage)}")
    progress(f"dashboard: {summary.dashboard_url}  (log in with the analyst key: {keys.analyst})")
    return summary


def production_name(engine: Engine) -> str:
    with session_scope(engine) as session:
        name = session.scalar(
            select(Checkpoint.name).where(Checkpoint.status == CheckpointStatus.production)
        )
    assert name is not None
    return name


def run_one_cycle(
    engine: Engine,
    settings: Settings,
    stack: FullStack,
    ops: Ops,
    keys: DemoKeys,
    config: DemoConfig,
    cycle: int,
    progress: Progress,
) -> CycleRecord:
    """Traffic on production, a training cycle, the canary's evaluation and the decision."""
    record = train_candidate(engine, settings, stack.gateway_url, keys, config, cycle, progress)
    if record.candidate is None:
        return record
    return judge_canary(engine, stack.gateway_url, ops, keys, config, record, progress)


def train_candidate(
    engine: Engine,
    settings: Settings,
    gateway: str,
    keys: DemoKeys,
    config: DemoConfig,
    cycle: int,
    progress: Progress,
) -> CycleRecord:
    """Developers' traffic on production, its rewards, then a training cycle on them: the
    record names the canary it published, or says why there is none."""
    production = production_name(engine)
    version = settings.reward_version
    progress(
        f"\n=== cycle {cycle}/{config.cycles}: production is {production},"
        f" reward formula {version} ==="
    )
    kind = "agent sessions" if config.agent else "one-turn requests"
    progress(f"  {config.train_users} developers work on training tasks ({kind}) ...")
    rewarded_traffic(
        engine,
        gateway,
        keys.ide,
        config,
        progress,
        label="training traffic",
        users=config.train_users,
        sessions=config.train_sessions,
        seed=config.seed * SEED_STRIDE + cycle,
        split="train",
        concurrency=config.concurrency,
    )
    started = time.monotonic()
    result = run_cycle(
        settings,
        config.train,
        engine=engine,
        held_out=held_out_for(config.train, engine),
        progress=lambda line: progress(f"  {line}"),
        on_published=lambda: notify_routing_changed_sync(settings.redis_url),
    )
    progress(f"  training cycle: {time.monotonic() - started:.0f} s")
    if result.checkpoint is None:
        progress(f"  no checkpoint this cycle: {result.status} ({result.reason})")
        return CycleRecord(cycle, version, None, f"no checkpoint: {result.status}")
    return CycleRecord(cycle, version, result.checkpoint, "")


def judge_canary(
    engine: Engine,
    gateway: str,
    ops: Ops,
    keys: DemoKeys,
    config: DemoConfig,
    record: CycleRecord,
    progress: Progress,
) -> CycleRecord:
    """The running canary `record.candidate` evaluated on held-out traffic at 50%, the
    monitors asked, and the decision: promoted when ahead on kept rate and the monitors
    let it, else rolled back. Returns a copy of `record` with what was measured and decided."""
    assert record.candidate is not None
    candidate = record.candidate
    production = production_name(engine)
    experiment_id = ramp_canary(ops, candidate, progress)
    evaluation = held_out_evaluation(
        engine,
        gateway,
        keys,
        config,
        progress,
        label="held-out evaluation",
        users=config.eval_users,
        seed=config.seed * SEED_STRIDE + 1000 + record.cycle,
    )
    body = results(engine, gateway, keys.analyst, experiment_id)
    progress("  A/B results on held-out tasks (from /analytics):")
    progress("  " + ab_table(body).replace("\n", "\n  "))
    ab = next(arm for arm in body["arms"] if not arm["is_control"])["metrics"]
    card = record.card
    if config.agent:
        card = candidate_card(evaluation, production, candidate, progress)
    found = monitor_alerts(engine, candidate, production, progress)
    alerts = [*record.alerts, *(metric for metric in found if metric not in record.alerts)]
    decision = decide_canary(ops, candidate, treatment_kept(body), alerts, progress)
    ops.stop_all()
    return replace(record, ab=ab, card=card, alerts=alerts, decision=decision)


def ramp_canary(ops: Ops, candidate: str, progress: Progress) -> int:
    """The running canary's experiment ramped to 50% for its evaluation; its id."""
    experiment_id: int = ops.running_experiments()[0]["id"]
    progress(f"  canary {candidate} healthy; ramping to 50% for evaluation")
    ops.ramp(experiment_id, {"control": 5000, "treatment": 5000})
    return experiment_id


def candidate_card(
    evaluation: SimulationReport, production: str, candidate: str, progress: Progress
) -> Scorecard | None:
    """The candidate's agent runs in its evaluation against production's, with both printed."""
    cards = scorecards(evaluation.runs, reference=production)
    progress("  agent runs on held-out tasks (the simulated IDE's books):")
    progress("  " + scorecard_table(cards).replace("\n", "\n  "))
    return next((card for card in cards if card.checkpoint == candidate), None)


def monitor_alerts(
    engine: Engine, candidate: str, production: str, progress: Progress
) -> list[str]:
    """The metrics the reward-hacking monitors alert on for `candidate`, each alert printed."""
    # The monitors run in every worker each minute; the demo asks now, at the end of the
    # evaluation window, instead of waiting for the next round.
    check_running_experiments(engine, window_length=timedelta(hours=1))
    metrics: list[str] = []
    with session_scope(engine) as session:
        alerts = session.scalars(
            select(Alert).where(Alert.checkpoint == candidate).order_by(Alert.id)
        ).all()
        for alert in alerts:
            if alert.metric not in metrics:
                metrics.append(alert.metric)
            against = "control" if alert.control_checkpoint == production else "reference"
            progress(
                f"  ALERT {alert.metric}: {candidate} {alert.canary_value:.3f} vs {against}"
                f" {alert.control_checkpoint} {alert.control_value:.3f}"
                f" (threshold {alert.threshold:g})"
            )
    return metrics


def decide_canary(
    ops: Ops, candidate: str, kept: dict[str, Any], alerts: list[str], progress: Progress
) -> str:
    """Promote the candidate when it is ahead on kept rate and the monitors let it, else roll
    it back; the decision, as the cycles' table names it."""
    versus = kept.get("vs_control") or {}
    if not versus.get("difference", 0) > 0:
        ops.roll_back(candidate)
        progress(f"  {candidate} does not win: rolled back")
        return "rolled back" + (" (alerts)" if alerts else "")
    refusal = ops.promote(candidate)
    if refusal is not None:
        ops.roll_back(candidate)
        progress(f"  {candidate} is ahead on kept rate, but promotion was refused: {refusal}")
        progress(f"  {candidate} rolled back")
        return "held back by alerts"
    verdict = "significantly" if versus.get("significant") else "not yet significantly"
    progress(f"  {candidate} is {verdict} ahead on kept rate: promoted to production")
    return "promoted"


def fix_reward(
    engine: Engine, stack: FullStack, settings: Settings, version: int, progress: Progress
) -> Settings:
    """What ops do about a reward hack: a corrected formula for new rewards, replayed over
    every finalized one (`rtrl rewards recompute`), so the next cycle learns from it."""
    progress(
        f"\n=== the monitors caught a reward hack: fixing the reward (formula {version}:"
        " a malformed call costs 1.0, a question is judged like any answer, the run's"
        " follow-up reaches every turn) ==="
    )
    for worker in stack.workers:
        worker.stop()
        worker.environment = {**worker.environment, "RTRL_REWARD_VERSION": str(version)}
        worker.start()
    changed = recompute_rewards(engine, version)
    progress(f"  rtrl rewards recompute --version {version}: {changed} rewards recomputed")
    return settings.model_copy(update={"reward_version": version})
