"""What a demo runs: its scenarios, their defaults, the training cycle's settings and the
settings a scenario runs on. The runs that chose these defaults are on the results pages
(docs/results/agent-demo.md, docs/results/reward-hacking.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.config import Settings, SettingsError
from rtrl.launcher import ensure_base
from sandbox.bases import HACKING_BASE
from sandbox.simulator.clients import ClientConfig
from trainer.config import TrainConfig

Progress = Callable[[str], None]
Scenario = Literal["learning", "reward-hacking"]
FLAWED_REWARD_VERSION = 0
"""The formula the reward-hacking scenario starts from (see `app.signals.rewards`)."""
SCENARIO_CYCLES: dict[Scenario, int] = {"learning": 2, "reward-hacking": 3}
"""Training cycles per scenario by default. A third learning cycle did not decide the measured
runs (docs/results/agent-demo.md, "Time"). The reward-hacking scenario needs a cycle for the
hack to emerge, one for the monitors to catch it and one on the fixed reward."""
SCENARIO_EVAL_USERS: dict[Scenario, int] = {"learning": 40, "reward-hacking": 48}
"""Evaluating developers per canary by default. The reward-hacking scenario's verdict is
its monitors', which alert only when the canary's difference from control is clear of noise
over users (`workers.monitors`): 48 still tell a hack from noise and keep the scenario near
its time (docs/results/reward-hacking.md, "Why the scenario runs as it does")."""
HACKING_BASE_DIR = "base-500"
"""Where the reward-hacking scenario's base (the shipped 500-step `HACKING_BASE`, when
RTRL_BASE_MODEL names none) lies under `RTRL_DATA_DIR/models`. A hack pays where the policy
expects to fail, and the 500-step base fails most runs, where the 1,000-step one's hack stays
under what a canary comparison resolves (docs/results/reward-hacking.md)."""
OFFLINE_SEED = 11
"""The held-out tasks and random stream of the final offline comparison."""
SEED_STRIDE = 100_000
"""How far apart two demo seeds' traffic seeds are: more than any seed a run uses."""


def demo_train_config(*, agent: bool, scenario: Scenario = "learning") -> TrainConfig:
    """The demo's training cycle: a larger step than production's default, so a few cycles
    show the loop learning.

    An agent cycle trains on about three times the samples of a one-turn cycle (every turn
    of a run is one), so it takes three times the optimizer steps: at the one-turn demo's
    rate and epochs (2e-3, 4) its updates broke the model's tool calls and its edits. Half
    the rate for half the epochs gives the update about the one-turn demo's size, and the
    wider clip range (0.4) lets each sampled token move as far as the trainer's tests let it.

    On agent traffic the learning scenario's gate runs candidates on held-out agent tasks
    (`agent_tasks`): a cycle now and then breaks tool calls on some operations while the
    one-turn task family's gate passes it, and the demo's served A/B is too small to see it.
    The reward-hacking scenario keeps the task family's gate, so a hacked candidate reaches
    its canary and the monitors, which is that scenario's story. The runs behind both are in
    docs/results/agent-demo.md.
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
    """Requests in flight from the developers whose traffic each cycle trains on. More serves
    the traffic sooner but raises each turn's latency, which is in the reward (formula 5
    charges time to first token over 1 s and time per token over 100 ms), so 8 stays until
    learning at 16 is measured over several runs (docs/results/agent-demo.md, "Time")."""
    eval_concurrency: int = 16
    """Requests in flight for the held-out evaluations (the canary's and the final
    comparison). Their developers are privacy-mode, so no reward their latency earns is
    trained on, and both arms of an evaluation share its load; 16 keeps vLLM busy where 8
    leaves it waiting between each run's turns (docs/results/agent-demo.md, "Time")."""
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
    seed: int = 0
    """Which tasks and developers: every traffic seed of the run (each cycle's training
    traffic, each canary's evaluation, the final comparison and its offline runs) is offset by
    `seed × SEED_STRIDE`; 0 is the demo as documented. `bench.demo_seeds` runs several."""
    train: TrainConfig = field(default_factory=lambda: demo_train_config(agent=True))
    """The training cycle's settings (see `demo_train_config`); any `RTRL_TRAIN_*` variable
    that is set overrides them (`rtrl demo` applies it)."""


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
