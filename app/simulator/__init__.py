"""The IDE simulator: synthetic developers who use the gateway exactly as an IDE plugin would."""

from app.simulator.clients import ClientConfig, ClientMode
from app.simulator.population import Developer, make_population
from app.simulator.report import CheckpointStats, ServedRequest, SimulationReport
from app.simulator.run import Workload, run_simulation, simulate

__all__ = [
    "CheckpointStats",
    "ClientConfig",
    "ClientMode",
    "Developer",
    "ServedRequest",
    "SimulationReport",
    "Workload",
    "make_population",
    "run_simulation",
    "simulate",
]
