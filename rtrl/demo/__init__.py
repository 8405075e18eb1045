"""`rtrl demo`: the closed loop on this machine, shown end to end (see `rtrl.demo.run`).

`config` holds the scenarios and their settings, `clients` the keys and the HTTP calls to
`/admin` and `/analytics`, `traffic` the simulated developers and their rewards, `records`
what the cycles produced, `tables` what is printed, `comparison` the final base-against-final
summary and `run` the run itself. What the CLI, the tests and the benchmarks use is here.
"""

from rtrl.demo.clients import Ops, create_keys
from rtrl.demo.comparison import offline_comparison
from rtrl.demo.config import (
    FLAWED_REWARD_VERSION,
    HACKING_BASE_DIR,
    OFFLINE_SEED,
    SCENARIO_CYCLES,
    SCENARIO_EVAL_USERS,
    DemoConfig,
    Scenario,
    demo_train_config,
    scenario_settings,
)
from rtrl.demo.records import CycleRecord, DemoSummary
from rtrl.demo.run import judge_canary, production_name, run_demo, train_candidate
from rtrl.demo.tables import hacking_verdict, served_line
from rtrl.demo.traffic import run_traffic, wait_for_rewards

__all__ = [
    "FLAWED_REWARD_VERSION",
    "HACKING_BASE_DIR",
    "OFFLINE_SEED",
    "SCENARIO_CYCLES",
    "SCENARIO_EVAL_USERS",
    "CycleRecord",
    "DemoConfig",
    "DemoSummary",
    "Ops",
    "Scenario",
    "create_keys",
    "demo_train_config",
    "hacking_verdict",
    "judge_canary",
    "offline_comparison",
    "production_name",
    "run_demo",
    "run_traffic",
    "scenario_settings",
    "served_line",
    "train_candidate",
    "wait_for_rewards",
]
