"""The IDE simulator: synthetic developers who use the gateway exactly as an IDE plugin would."""

from sandbox.simulator.clients import ClientConfig, ClientMode
from sandbox.simulator.population import Developer, make_population
from sandbox.simulator.report import CheckpointStats, ServedRequest, SimulationReport
from sandbox.simulator.run import Workload, compressed_time_settings, run_simulation, simulate

__all__ = [
    "CheckpointStats",
    "ClientConfig",
    "ClientMode",
    "Developer",
    "ServedRequest",
    "SimulationReport",
    "Workload",
    "compressed_time_settings",
    "make_population",
    "run_simulation",
    "simulate",
]
