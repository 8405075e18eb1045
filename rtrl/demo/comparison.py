"""The demo's summary: base against the final checkpoint on held-out tasks nobody trained on,
served 50/50 and, on agent traffic, sampled offline on many more runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from transformers import PreTrainedTokenizerFast

from app.abtest.stats import Comparison
from app.config import Settings
from app.db import session_scope
from app.models import Checkpoint
from app.registry.experiments import start_canary
from app.registry.routing import notify_routing_changed_sync
from rtrl.demo.clients import DemoKeys, Ops, results, treatment_kept
from rtrl.demo.config import OFFLINE_SEED, SEED_STRIDE, DemoConfig, Progress
from rtrl.demo.records import DemoSummary
from rtrl.demo.tables import ab_table, offline_solved_line, served_kept_line
from rtrl.demo.traffic import held_out_evaluation, phase_bar
from sandbox.agent_runs import (
    RUN_METRICS,
    PolicyRuns,
    compare_runs,
    load_policy,
    run_agents,
    runs_table,
)
from sandbox.agent_tasks import agent_tasks
from sandbox.simulator.scorecard import Scorecard, scorecard_table, scorecards


def final_comparison(
    engine: Engine,
    settings: Settings,
    ops: Ops,
    config: DemoConfig,
    keys: DemoKeys,
    gateway: str,
    base: str,
    final: str,
    progress: Progress,
) -> DemoSummary:
    """Base vs the last checkpoint, 50/50, on held-out tasks nobody trained on."""
    dashboard = f"{gateway}/dashboard"
    if final == base:
        progress("\nno checkpoint beat the base model; nothing to compare")
        return DemoSummary([], final, None, None, None, None, None, dashboard)
    progress(f"\n=== summary: {base} vs {final} on held-out tasks, 50/50 ===")
    experiment_id = start_holdback(engine, settings, base, final)
    evaluation = held_out_evaluation(
        engine,
        gateway,
        keys,
        config,
        progress,
        label="held-out comparison",
        users=config.eval_users * 2,
        seed=config.seed * SEED_STRIDE + 9999,
    )
    body = results(engine, gateway, keys.analyst, experiment_id)
    progress(ab_table(body))
    cards: list[Scorecard] = []
    if config.agent:
        cards = scorecards(evaluation.runs, reference=base)
        progress("agent runs (the simulated IDE's books):")
        progress(scorecard_table(cards))
    ops.stop_all()
    offline: dict[str, Comparison | None] = {}
    if config.agent and config.offline_runs > 0:
        offline = offline_differences(engine, settings, base, final, config, progress)
    for line in (served_kept_line(body), offline_solved_line(offline.get("solved"))):
        if line is not None:
            progress(line)
    return holdback_summary(body, final, dashboard, cards, offline)


def start_holdback(engine: Engine, settings: Settings, base: str, final: str) -> int:
    """A holdback experiment, the retired base model against the last checkpoint at 50%, live
    on every gateway; its id. `/admin` rightly refuses experiments on retired checkpoints,
    so this one is set up directly."""
    with session_scope(engine) as session:
        control = session.scalar(select(Checkpoint).where(Checkpoint.name == base))
        treatment = session.scalar(select(Checkpoint).where(Checkpoint.name == final))
        assert control is not None and treatment is not None
        experiment_id = start_canary(
            session,
            control=control,
            treatment=treatment,
            treatment_bps=5000,
            created_by="rtrl demo holdback",
        ).id
    notify_routing_changed_sync(settings.redis_url)
    time.sleep(2)  # every gateway reloads its routing table on that message
    return experiment_id


def holdback_summary(
    body: dict[str, Any],
    final: str,
    dashboard: str,
    cards: list[Scorecard],
    offline: dict[str, Comparison | None],
) -> DemoSummary:
    """The summary of a holdback's `/analytics` results, scorecards and offline runs."""
    control_kept = next(a for a in body["arms"] if a["is_control"])["metrics"]["kept"]
    kept = treatment_kept(body)
    versus = kept.get("vs_control") or {}
    return DemoSummary(
        checkpoints=[],
        final_checkpoint=final,
        base_kept=control_kept.get("value"),
        final_kept=kept.get("value"),
        difference=versus.get("difference"),
        ci_low=versus.get("ci_low"),
        ci_high=versus.get("ci_high"),
        dashboard_url=dashboard,
        final_cards=cards,
        offline=offline,
    )


def offline_differences(
    engine: Engine,
    settings: Settings,
    base: str,
    final: str,
    config: DemoConfig,
    progress: Progress,
) -> dict[str, Comparison | None]:
    """The final checkpoint minus base on `config.offline_runs` offline runs each, per
    `RUN_METRICS` name."""
    base_runs, final_runs = offline_comparison(
        engine,
        settings,
        base,
        final,
        config.offline_runs,
        progress,
        config.progress_bars,
        seed=config.seed * SEED_STRIDE + OFFLINE_SEED,
    )
    return {metric: compare_runs(final_runs.runs, base_runs.runs, metric) for metric in RUN_METRICS}


def offline_comparison(
    engine: Engine,
    settings: Settings,
    base: str,
    final: str,
    runs: int,
    progress: Progress,
    bars: bool = True,
    seed: int = OFFLINE_SEED,
) -> list[PolicyRuns]:
    """Base and the final checkpoint on `runs` held-out agent tasks each, sampled offline with
    transformers the way the simulated IDE runs them (the same tasks and random stream for
    both): many more runs than the served A/B affords, so a cycle's gain can be resolved.
    Prints their table and returns their runs, base first."""
    with session_scope(engine) as session:
        adapters = {
            c.name: c.adapter_path
            for c in session.scalars(select(Checkpoint).where(Checkpoint.name.in_([base, final])))
        }
    progress(f"\noffline: {runs} held-out agent runs per model, {base} and {final} ...")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(settings.base_model_path)
    tasks = agent_tasks(seed, runs, "heldout")
    policies = []
    with phase_bar("offline runs", 2, bars) as advance:
        for done, name in enumerate((base, final), start=1):
            adapter = adapters.get(name)
            policy = load_policy(settings.base_model_path, Path(adapter) if adapter else None)
            policies.append(PolicyRuns(name, run_agents(policy, tokenizer, tasks, seed=seed)))
            advance(done)
    progress(runs_table(policies))
    return policies
