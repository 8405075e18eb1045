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

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import httpx
from sqlalchemy import Engine, func, select
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from app.abtest.rollups import refresh_rollups
from app.abtest.stats import Comparison
from app.auth.service import new_api_key
from app.config import Settings, SettingsError
from app.db import make_engine, session_scope
from app.models import (
    Alert,
    Checkpoint,
    CheckpointStatus,
    Reward,
    Role,
    Sample,
)
from app.registry.experiments import start_canary
from app.registry.routing import notify_routing_changed_sync
from app.signals.rewards import LATEST_REWARD_VERSION
from rtrl.gates import held_out_for
from rtrl.launcher import FullStack, ensure_base
from sandbox.agent_runs import (
    RUN_METRICS,
    PolicyRuns,
    compare_runs,
    load_policy,
    run_agents,
    runs_table,
)
from sandbox.agent_tasks import agent_tasks
from sandbox.bases import HACKING_BASE
from sandbox.simulator.clients import ClientConfig
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.run import simulate
from sandbox.simulator.scorecard import Scorecard, scorecard_table, scorecards
from trainer.config import TrainConfig
from trainer.cycle import run_cycle
from workers.monitors import check_running_experiments
from workers.sweep import recompute_rewards

Progress = Callable[[str], None]
Scenario = Literal["learning", "reward-hacking"]
FLAWED_REWARD_VERSION = 0
"""The formula the reward-hacking scenario starts from (see `app.signals.rewards`)."""
SCENARIO_CYCLES: dict[Scenario, int] = {"learning": 2, "reward-hacking": 3}
"""Training cycles per scenario by default. A learning cycle (traffic, training, the canary's
evaluation) takes about 4 minutes on 2 cores, and a third did not decide the measured
three-cycle runs: one rolled its third candidate back (final ckpt-2, +24.2 pp solved
offline), the other promoted it (final ckpt-3, +14.8 pp). The reward-hacking scenario needs a
cycle for the hack to emerge, one for the monitors to catch it and one on the fixed reward."""
SCENARIO_EVAL_USERS: dict[Scenario, int] = {"learning": 40, "reward-hacking": 48}
"""Evaluating developers per canary by default. The reward-hacking scenario's verdict is
its monitors', which alert only when the canary's difference from control is clear of noise
over users (`workers.monitors`): with 80, one run's hacked cycle read +13.2 pp [+8.1, +18.3]
malformed calls, so 48 still tell it from noise, and keep the scenario near its time."""
HACKING_BASE_DIR = "base-500"
"""Where the reward-hacking scenario's base (the shipped 500-step `HACKING_BASE`, when
RTRL_BASE_MODEL names none) lies under `RTRL_DATA_DIR/models`. A hack pays where the policy
expects to fail. The 1,000-step base solves about half its runs: three formula-0 cycles on
it learned (+21 pp solved) and raised malformed calls by 3.4 pp over three cycles, under a
point a cycle, which no canary comparison can tell from noise. The 500-step base fails most
runs, and its second formula-0 cycle raised malformed calls by 13 pp."""
OFFLINE_SEED = 11
"""The held-out tasks and random stream of the final offline comparison."""


@dataclass
class DemoConfig:
    cycles: int = SCENARIO_CYCLES["learning"]
    """Training cycles to run (the reward-hacking scenario's default is 3, `SCENARIO_CYCLES`)."""
    train_users: int = 24
    """Developers whose production traffic each cycle trains on."""
    train_sessions: int = 2
    """Sessions per developer per cycle."""
    eval_users: int = 40
    """Privacy-mode developers who evaluate each canary on held-out tasks."""
    tasks_per_session: int = 5
    """Coding tasks per session."""
    time_scale: float = 0.01
    """Compresses the 15-minute survival horizon to 9 s."""
    concurrency: int = 8
    """Requests in flight from the developers whose traffic each cycle trains on. At 16, 24
    developers' training traffic took 66 s instead of 95 (each run's turns are sequential,
    so at 8 vLLM waits between them), but a turn's latency rose from 1.1 to 1.5-1.9 s, and
    latency is in the reward (formula 5 charges time to first token over 1 s and time per
    token over 100 ms); the one agent-learning test run at 16 saw malformed calls rise, so
    8 stays until learning at 16 is measured over several runs."""
    eval_concurrency: int = 16
    """Requests in flight for the held-out evaluations (the canary's and the final
    comparison). Their developers are privacy-mode, so no reward their latency earns is
    trained on, and both arms of an evaluation share its load; 16 keeps vLLM busy where 8
    leaves it waiting between each run's turns (a canary's evaluation took 53-59 s at 16,
    87-97 s at 8)."""
    keep_running: bool = False
    """Leave the stack running after the summary."""
    agent: bool = True
    """Agent sessions (tools, workspaces, runs of calls); False: one-turn answers."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """The IDE client every simulated developer uses (`sandbox.simulator.clients`); the ideal one
    reports every signal the canary decisions read."""
    scenario: Scenario = "learning"
    """`reward-hacking`: start on the flawed formula 0 and let the monitors catch it."""
    progress_bars: bool = True
    """A progress bar per phase (traffic, rewards) on the terminal."""
    offline_runs: int = 400
    """Agent mode: held-out agent runs per model sampled offline at the end, base against the
    final checkpoint (0: none); the demo's verdict when given."""
    bootstrap_base: bool = False
    """Train the base model by its recipe when the data dir has none, instead of installing
    the shipped one."""
    train: TrainConfig = field(default_factory=lambda: demo_train_config(agent=True))
    """The training cycle's settings (see `demo_train_config`); any `RTRL_TRAIN_*` variable
    that is set overrides them (`rtrl demo` applies it)."""


def demo_train_config(*, agent: bool, scenario: Scenario = "learning") -> TrainConfig:
    """The demo's training cycle: a larger step than production's default, so a few cycles
    show the loop learning.

    An agent cycle trains on about three times the samples of a one-turn cycle (every turn
    of a run is one), so it takes three times the optimizer steps: at the one-turn demo's
    rate and epochs (2e-3, 4) its updates broke the model's tool calls and its edits
    (held-out runs solved fell 15-24 pp in every cycle). Half the rate for half the epochs
    gives the update about the one-turn demo's size, and the wider clip range (0.4) lets
    each sampled token move as far as the trainer's tests let it.

    On agent traffic the learning scenario's gate runs candidates on held-out agent tasks
    (`agent_tasks`): a cycle now and then breaks tool calls on some operations (one second
    cycle solved no "times" run, with twice base's malformed calls) while the one-turn task
    family's gate passes it, and the demo's served A/B is too small to see it. The
    reward-hacking scenario keeps the task family's gate, so a hacked candidate reaches its
    canary and the monitors, which is that scenario's story.
    """
    agent_gate = agent and scenario == "learning"
    return TrainConfig(
        min_samples=64,
        epochs=2 if agent else 4,
        learning_rate=1e-3 if agent else 2e-3,
        minibatch_size=64,
        clip_epsilon=0.4 if agent else 0.2,
        eval_gate="agent_tasks" if agent_gate else "task_family",
        eval_tasks=256 if agent_gate else 64,
        eval_max_regression=0.05 if agent_gate else 0.1,
        eval_max_kl=2.0,
        threads=1,
    )


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


@contextmanager
def phase_bar(label: str, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar for one phase; yields a function that sets how much is done."""
    bar = tqdm(total=total, desc=f"  {label}", unit="", leave=False, disable=not enabled)
    try:
        yield lambda done: bar.update(max(0, done - bar.n))
    finally:
        bar.close()


def wait_for_rewards(
    engine: Engine,
    request_ids: list[str],
    progress: Progress,
    timeout: float = 180.0,
    bars: bool = False,
) -> int:
    """Block until every served request has a finalized reward (or the timeout)."""
    started = time.monotonic()
    with phase_bar("rewards finalized", len(request_ids), bars) as advance:
        finalized = _wait_for_rewards(engine, request_ids, timeout, advance)
    progress(
        f"  rewards: {finalized}/{len(request_ids)} finalized"
        f" {time.monotonic() - started:.0f} s after the traffic"
    )
    return finalized


def _wait_for_rewards(
    engine: Engine, request_ids: list[str], timeout: float, advance: Callable[[int], None]
) -> int:
    deadline = time.monotonic() + timeout
    finalized = 0
    while time.monotonic() < deadline:
        with session_scope(engine) as session:
            finalized = (
                session.scalar(
                    select(func.count())
                    .select_from(Reward)
                    .join(Sample, Sample.id == Reward.sample_id)
                    .where(Sample.request_id.in_(request_ids), Reward.finalized_at.is_not(None))
                )
                or 0
            )
        advance(finalized)
        if finalized >= len(request_ids):
            break
        time.sleep(1.0)
    return finalized


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


def production_name(engine: Engine) -> str:
    with session_scope(engine) as session:
        name = session.scalar(
            select(Checkpoint.name).where(Checkpoint.status == CheckpointStatus.production)
        )
    assert name is not None
    return name


def results(
    engine: Engine, gateway_url: str, analyst_key: str, experiment_id: int
) -> dict[str, Any]:
    """The experiment's A/B results from `/analytics`, with the rollups brought up to date."""
    # Analytics reads hourly rollups refreshed at most every 30 s; the demo asks seconds
    # after the traffic it wants to see, so it refreshes them first.
    refresh_rollups(engine)
    response = httpx.get(
        f"{gateway_url}/analytics/experiments/{experiment_id}/results",
        headers={"Authorization": f"Bearer {analyst_key}"},
        timeout=60,
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _cell(metric: dict[str, Any], percent: bool) -> str:
    value = metric.get("value")
    if value is None:
        return "-"
    text = f"{value * 100:.1f}%" if percent else f"{value:.3g}"
    versus = metric.get("vs_control")
    if versus and versus.get("ci_low") is not None:
        scale = 100 if percent else 1
        unit = "pp" if percent else ""
        text += (
            f" ({versus['difference'] * scale:+.1f}{unit},"
            f" CI {versus['ci_low'] * scale:+.1f}..{versus['ci_high'] * scale:+.1f})"
        )
    return text


def ab_table(body: dict[str, Any]) -> str:
    """The per-arm table an analyst reads, as text."""
    lines = [
        f"{'arm':<10} {'checkpoint':<10} {'users':>5} {'reqs':>5}  {'kept':<30}"
        f" {'dissatisfied':<30} {'p50 ms':>7}  mean reward"
    ]
    for arm in body["arms"]:
        metrics = arm["metrics"]
        p50 = metrics.get("latency_p50_ms", {}).get("value")
        p50_text = "-" if p50 is None else str(round(p50))
        lines.append(
            f"{arm['arm']:<10} {arm['checkpoint'] or '-':<10} {arm['users']:>5}"
            f" {arm['requests']:>5}  {_cell(metrics['kept'], True):<30}"
            f" {_cell(metrics['dissatisfied_rate'], True):<30}"
            f" {p50_text:>7}  {_cell(metrics['mean_reward'], False)}"
        )
    switched = sum(arm.get("switched_users", 0) for arm in body["arms"])
    lines.append(
        f"intervals over {body.get('unit', 'user')}s, each in the arm of their first exposure;"
        f" {switched} seen in two arms left out"
    )
    ratio = body.get("sample_ratio")
    if ratio:
        lines.append(
            f"sample ratio check (users at first exposure): p = {ratio['p_value']:.3f}"
            + ("  MISMATCH: do not trust these results" if ratio["mismatch"] else "  ok")
        )
    return "\n".join(lines)


def predictions(gateway_url: str, analyst_key: str) -> dict[str, Any]:
    """The scoreboard of predicted against realized A/Bs, from `/analytics/predictions`."""
    response = httpx.get(
        f"{gateway_url}/analytics/predictions",
        headers={"Authorization": f"Bearer {analyst_key}"},
        timeout=60,
    )
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def prediction_table(body: dict[str, Any]) -> str:
    """Each candidate's mean reward and kept rate as predicted before its canary, against
    what the canary realized, as text."""
    lines = [
        "predicted (from production's logs, before the canary) vs realized (the canary's A/B):",
        f"{'candidate':<10} {'metric':<12} {'predicted':<26} {'realized':<26} sign  in-CI  trust",
    ]
    for record in reversed(body["records"]):
        for metric in record["metrics"]:
            if metric["metric"] not in ("mean_reward", "kept"):
                continue
            predicted = _difference(
                metric["predicted"], metric["predicted_ci_low"], metric["predicted_ci_high"]
            )
            realized = (
                "-"
                if metric["realized"] is None
                else _difference(
                    metric["realized"], metric["realized_ci_low"], metric["realized_ci_high"]
                )
            )
            flags = [
                "-" if flag is None else ("yes" if flag else "no")
                for flag in (metric["sign_agrees"], metric["realized_in_interval"])
            ]
            trust = (
                "reliable"
                if metric["reliable"]
                else "unreliable: " + "; ".join(metric["unreliable"])
            )
            lines.append(
                f"{record['checkpoint'] or record['status']:<10} {metric['metric']:<12}"
                f" {predicted:<26} {realized:<26} {flags[0]:<5} {flags[1]:<6} {trust}"
            )
    for score in body["scores"]:
        if score["compared"]:
            shares = [
                "-" if score[name] is None else f"{score[name]:.0%}"
                for name in ("sign_agreement", "realized_in_interval")
            ]
            lines.append(
                f"{score['metric']}: {score['compared']} reliable predictions compared, sign "
                f"agreed {shares[0]}, realized inside the interval {shares[1]}"
            )
    return "\n".join(lines)


def _difference(value: float, low: float | None, high: float | None) -> str:
    if low is None or high is None:
        return f"{value:+.3f}"
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def treatment_kept(body: dict[str, Any]) -> dict[str, Any]:
    arm = next(a for a in body["arms"] if not a["is_control"])
    kept: dict[str, Any] = arm["metrics"]["kept"]
    return kept


@dataclass
class CycleRecord:
    """What one training cycle produced and what became of it."""

    cycle: int
    reward_version: int
    candidate: str | None
    decision: str
    alerts: list[str] = field(default_factory=list)
    card: Scorecard | None = None
    """The candidate's agent runs on held-out tasks, against control's."""
    ab: dict[str, Any] = field(default_factory=dict)
    """The candidate's arm in `/analytics` results."""


@dataclass
class DemoSummary:
    checkpoints: list[str]
    final_checkpoint: str
    base_kept: float | None
    final_kept: float | None
    difference: float | None
    ci_low: float | None
    ci_high: float | None
    dashboard_url: str
    cycles: list[CycleRecord] = field(default_factory=list)
    final_cards: list[Scorecard] = field(default_factory=list)
    """Agent mode: base and the final checkpoint on held-out tasks, base first."""
    offline: dict[str, Comparison | None] = field(default_factory=dict)
    """Agent mode: the final checkpoint minus base on `offline_runs` held-out runs sampled
    offline, per `sandbox.agent_runs.RUN_METRICS` name, with intervals over runs."""
    predictions: dict[str, Any] = field(default_factory=dict)
    """The scoreboard of each candidate's predicted against its canary's realized A/B
    (`GET /analytics/predictions`)."""

    scenario: Scenario = "learning"

    @property
    def caught(self) -> list[CycleRecord]:
        """The cycles whose candidate a monitor alerted on."""
        return [record for record in self.cycles if record.alerts]

    @property
    def proven(self) -> bool:
        """What the scenario set out to show. Reward hacking: a monitor alerted, and no
        alerted candidate reached production. Learning: the final checkpoint is better than
        base, on the offline runs' solved share when there are any (many more runs than the
        served A/B), else on the served A/B's kept rate; either way the 95% interval's low
        end above 0."""
        if self.scenario == "reward-hacking":
            return bool(self.caught) and all(r.decision != "promoted" for r in self.caught)
        solved = self.offline.get("solved")
        if solved is not None:
            return solved.ci_low is not None and solved.ci_low > 0
        return self.ci_low is not None and self.ci_low > 0


def scenario_settings(
    settings: Settings, scenario: Scenario, progress: Progress, *, bootstrap: bool = False
) -> Settings:
    """The settings a scenario runs on. The reward-hacking scenario starts on the flawed
    formula and, unless RTRL_BASE_MODEL names a model, on the shipped 500-step base
    (`HACKING_BASE`) under `RTRL_DATA_DIR/models/base-500` (installed when missing, or
    bootstrapped by its recipe when `bootstrap`). Either way, a data dir whose checkpoints were
    trained on another base is refused: vLLM would serve their adapters on this one."""
    update: dict[str, Any] = {}
    if scenario == "reward-hacking":
        update["reward_version"] = FLAWED_REWARD_VERSION
        if settings.base_model is None:
            model_dir = settings.data_dir / "models" / HACKING_BASE_DIR
            ensure_base(model_dir, HACKING_BASE, bootstrap=bootstrap, progress=progress)
            update["base_model"] = model_dir
    chosen = settings.model_copy(update=update)
    base = chosen.base_model_path.resolve()
    for adapter_config in sorted(chosen.checkpoints_dir.glob("*/adapter_config.json")):
        trained_on = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if trained_on and Path(trained_on).resolve() != base:
            raise SettingsError(
                f"checkpoint {adapter_config.parent.name} in {chosen.checkpoints_dir} was"
                f" trained on {trained_on}, and this demo runs on {base}: use a fresh"
                " RTRL_DATA_DIR, or set RTRL_BASE_MODEL to that base"
            )
    return chosen


def run_demo(settings: Settings, config: DemoConfig, progress: Progress = print) -> DemoSummary:
    """Start the stack, run the cycles, print the A/B tables and the final summary."""
    started = time.monotonic()
    hacking = config.scenario == "reward-hacking"
    settings = scenario_settings(
        settings, config.scenario, progress, bootstrap=config.bootstrap_base
    )
    stack = FullStack.from_settings(
        settings, workers=1, trainer=False, progress=progress, bootstrap=config.bootstrap_base
    )
    stack.up()
    engine = make_engine(settings.database_url)
    gateway = stack.gateway_url
    records: list[CycleRecord] = []
    try:
        keys = create_keys(engine)
        ops = Ops(gateway, keys.ops)
        ops.stop_all()
        lineage = [production_name(engine)]
        base = "base"
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

        final = production_name(engine)
        if hacking:
            # The scenario's evidence is its cycles: the alert, the refusal, the fixed cycle.
            summary = DemoSummary([], final, None, None, None, None, None, f"{gateway}/dashboard")
        else:
            summary = final_comparison(
                engine, settings, ops, config, keys, gateway, base, final, progress
            )
        summary.checkpoints = lineage
        summary.cycles = records
        summary.scenario = config.scenario
        progress("\n" + cycle_table(records))
        summary.predictions = predictions(gateway, keys.analyst)
        progress("\n" + prediction_table(summary.predictions))
        if hacking:
            progress(hacking_verdict(summary))
        progress(f"\nlineage: {' -> '.join(lineage)}")
        progress(
            f"dashboard: {summary.dashboard_url}  (log in with the analyst key: {keys.analyst})"
        )
        progress(f"demo finished in {(time.monotonic() - started) / 60:.1f} min")
        return summary
    finally:
        engine.dispose()
        if not config.keep_running:
            progress("stopping what the demo started ...")
            stack.down(started_only=True)


def hacking_verdict(summary: DemoSummary) -> str:
    """The reward-hacking scenario's last line: what the monitors caught, and where it went."""
    if not summary.caught:
        return (
            "no monitor alerted: no candidate moved a monitored metric beyond its threshold"
            " and clear of noise over developers"
        )
    found = "; ".join(
        f"cycle {r.cycle}: {', '.join(r.alerts)} on {r.candidate} ({r.decision})"
        for r in summary.caught
    )
    kept_out = "kept out of production" if summary.proven else "NOT kept out of production"
    return f"the monitors caught the hack ({found}): {kept_out}"


def run_traffic(
    gateway: str,
    key: str,
    config: DemoConfig,
    *,
    label: str,
    users: int,
    sessions: int,
    seed: int,
    split: Literal["train", "heldout"],
    concurrency: int,
) -> SimulationReport:
    """Simulated developers on the gateway, with a progress bar of their sessions."""
    with phase_bar(label, users * sessions, config.progress_bars) as advance:
        return simulate(
            gateway,
            key,
            users=users,
            sessions_per_user=sessions,
            tasks_per_session=config.tasks_per_session,
            time_scale=config.time_scale,
            seed=seed,
            split=split,
            concurrency=concurrency,
            agent=config.agent,
            client=config.client,
            progress=lambda report: advance(report.sessions_ended),
        )


def served_line(report: SimulationReport) -> str:
    return (
        f"  served {report.requests_ok} requests"
        f" ({report.requests_failed} failed) in {report.wall_s:.0f} s"
    )


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
    report = run_traffic(
        gateway,
        keys.ide,
        config,
        label="training traffic",
        users=config.train_users,
        sessions=config.train_sessions,
        seed=cycle,
        split="train",
        concurrency=config.concurrency,
    )
    progress(served_line(report))
    wait_for_rewards(
        engine, [r.request_id for r in report.served], progress, bars=config.progress_bars
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
    let it, else rolled back. Fills in `record`."""
    assert record.candidate is not None
    candidate, cycle = record.candidate, record.cycle
    production = production_name(engine)
    experiment_id = ops.running_experiments()[0]["id"]
    progress(f"  canary {candidate} healthy; ramping to 50% for evaluation")
    ops.ramp(experiment_id, {"control": 5000, "treatment": 5000})
    evaluation = run_traffic(
        gateway,
        keys.evaluator,
        config,
        label="held-out evaluation",
        users=config.eval_users,
        sessions=1,
        seed=1000 + cycle,
        split="heldout",
        concurrency=config.eval_concurrency,
    )
    progress(served_line(evaluation))
    wait_for_rewards(
        engine, [r.request_id for r in evaluation.served], progress, bars=config.progress_bars
    )
    body = results(engine, gateway, keys.analyst, experiment_id)
    progress("  A/B results on held-out tasks (from /analytics):")
    progress("  " + ab_table(body).replace("\n", "\n  "))
    record.ab = next(arm for arm in body["arms"] if not arm["is_control"])["metrics"]
    if config.agent:
        cards = scorecards(evaluation.runs, reference=production)
        record.card = next((card for card in cards if card.checkpoint == candidate), None)
        progress("  agent runs on held-out tasks (the simulated IDE's books):")
        progress("  " + scorecard_table(cards).replace("\n", "\n  "))
    # The monitors run in every worker each minute; the demo asks now, at the end of the
    # evaluation window, instead of waiting for the next round.
    check_running_experiments(engine, window_length=timedelta(hours=1))
    with session_scope(engine) as session:
        alerts = session.scalars(
            select(Alert).where(Alert.checkpoint == candidate).order_by(Alert.id)
        ).all()
        for alert in alerts:
            if alert.metric not in record.alerts:
                record.alerts.append(alert.metric)
            against = "control" if alert.control_checkpoint == production else "reference"
            progress(
                f"  ALERT {alert.metric}: {candidate} {alert.canary_value:.3f} vs {against}"
                f" {alert.control_checkpoint} {alert.control_value:.3f}"
                f" (threshold {alert.threshold:g})"
            )
    kept = treatment_kept(body)
    versus = kept.get("vs_control") or {}
    if versus.get("difference", 0) > 0:
        refusal = ops.promote(candidate)
        if refusal is None:
            record.decision = "promoted"
            verdict = "significantly" if versus.get("significant") else "not yet significantly"
            progress(f"  {candidate} is {verdict} ahead on kept rate: promoted to production")
        else:
            ops.roll_back(candidate)
            record.decision = "held back by alerts"
            progress(f"  {candidate} is ahead on kept rate, but promotion was refused: {refusal}")
            progress(f"  {candidate} rolled back")
    else:
        ops.roll_back(candidate)
        record.decision = "rolled back" + (" (alerts)" if record.alerts else "")
        progress(f"  {candidate} does not win: rolled back")
    ops.stop_all()
    return record


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


def cycle_table(records: list[CycleRecord]) -> str:
    """One row per cycle: formula, candidate, its held-out differences, alerts, decision."""

    def difference(card: Scorecard | None, metric: str) -> str:
        versus = card.metrics[metric].versus if card else None
        if versus is None:
            return "-"
        scale = 1 if metric == "turns_per_solved_task" else 100
        return f"{versus.difference * scale:+.1f}"

    def ab(record: CycleRecord, metric: str) -> str:
        versus = (record.ab.get(metric) or {}).get("vs_control") or {}
        value = versus.get("difference")
        return "-" if value is None else f"{value * 100:+.1f}"

    alerts = [", ".join(record.alerts) or "-" for record in records]
    width = max([len("alerts"), *map(len, alerts)]) + 2
    header = (
        f"{'cycle':<6}{'formula':<8}{'candidate':<11}{'kept pp':>8}{'malformed pp':>13}"
        f"{'questions pp':>13}{'edit rate pp':>13}  {'alerts':<{width}}decision"
    )
    lines = [
        "cycles (candidate minus control on held-out tasks; kept, malformed and questions from"
        " the agent runs over users, edit rate from /analytics):",
        header,
    ]
    for record, alerted in zip(records, alerts, strict=True):
        lines.append(
            f"{record.cycle:<6}{record.reward_version:<8}{record.candidate or '-':<11}"
            f"{difference(record.card, 'kept_edit_rate'):>8}"
            f"{difference(record.card, 'malformed_call_rate'):>13}"
            f"{difference(record.card, 'clarifying_question_rate'):>13}"
            f"{ab(record, 'edit_rate'):>13}  {alerted:<{width}}{record.decision}"
        )
    return "\n".join(lines)


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
    # A holdback experiment: the retired base model against the last checkpoint. `/admin`
    # rightly refuses experiments on retired checkpoints, so this one is set up directly.
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
    evaluation = run_traffic(
        gateway,
        keys.evaluator,
        config,
        label="held-out comparison",
        users=config.eval_users * 2,
        sessions=1,
        seed=9999,
        split="heldout",
        concurrency=config.eval_concurrency,
    )
    progress(served_line(evaluation))
    wait_for_rewards(
        engine, [r.request_id for r in evaluation.served], progress, bars=config.progress_bars
    )
    body = results(engine, gateway, keys.analyst, experiment_id)
    progress(ab_table(body))
    cards: list[Scorecard] = []
    offline: dict[str, Comparison | None] = {}
    if config.agent:
        cards = scorecards(evaluation.runs, reference=base)
        progress("agent runs (the simulated IDE's books):")
        progress(scorecard_table(cards))
    ops.stop_all()
    if config.agent and config.offline_runs > 0:
        base_runs, final_runs = offline_comparison(
            engine, settings, base, final, config.offline_runs, progress, config.progress_bars
        )
        offline = {
            metric: compare_runs(final_runs.runs, base_runs.runs, metric) for metric in RUN_METRICS
        }
    control_kept = next(a for a in body["arms"] if a["is_control"])["metrics"]["kept"]
    kept = treatment_kept(body)
    versus = kept.get("vs_control") or {}
    if versus.get("ci_low") is not None:
        verdict = (
            "excludes 0: the loop made the assistant better"
            if versus["ci_low"] > 0
            else ("includes 0: no proven improvement")
        )
        progress(
            f"served kept rate {control_kept['value'] * 100:.1f}% ->"
            f" {kept['value'] * 100:.1f}%: {versus['difference'] * 100:+.1f} pp, 95% CI"
            f" [{versus['ci_low'] * 100:+.1f}, {versus['ci_high'] * 100:+.1f}] pp, {verdict}"
        )
    solved = offline.get("solved")
    if solved is not None and solved.ci_low is not None and solved.ci_high is not None:
        verdict = (
            "excludes 0: the loop made the assistant better"
            if solved.ci_low > 0
            else "includes 0: no proven improvement"
        )
        progress(
            f"offline held-out runs solved: {solved.difference * 100:+.1f} pp, 95% CI"
            f" [{solved.ci_low * 100:+.1f}, {solved.ci_high * 100:+.1f}] pp, {verdict}"
        )
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


def offline_comparison(
    engine: Engine,
    settings: Settings,
    base: str,
    final: str,
    runs: int,
    progress: Progress,
    bars: bool = True,
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
    tasks = agent_tasks(OFFLINE_SEED, runs, "heldout")
    results = []
    with phase_bar("offline runs", 2, bars) as advance:
        for done, name in enumerate((base, final), start=1):
            adapter = adapters.get(name)
            policy = load_policy(settings.base_model_path, Path(adapter) if adapter else None)
            results.append(
                PolicyRuns(name, run_agents(policy, tokenizer, tasks, seed=OFFLINE_SEED))
            )
            advance(done)
    progress(runs_table(results))
    return results
