"""A population of developers working against a gateway at once, until the work is done."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from app.config import Settings
from sandbox.agent_tasks import agent_task
from sandbox.simulator.agent import AgentSession
from sandbox.simulator.clients import ClientConfig, ide_for_session
from sandbox.simulator.gateway import GatewayClient
from sandbox.simulator.population import Developer, make_population
from sandbox.simulator.reactions import SURVIVAL_WINDOWS_S
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.session import DeveloperSession, pick_tasks
from sandbox.tasks import Split, Task, all_tasks

Progress = Callable[[SimulationReport], None]


@dataclass(frozen=True)
class Workload:
    """What to simulate; each developer runs one session at a time."""

    users: int = 10
    sessions_per_user: int | None = None
    """Sessions each developer runs; None: as many as `duration_s` allows (1 without it)."""
    duration_s: float | None = None
    """No session starts, and no session asks for another task, after this many seconds."""
    rate: float | None = None
    """Most sessions started per second, all developers together; None: no pacing."""
    tasks_per_session: int = 5
    time_scale: float = 1.0
    """Multiplies every wait (survival windows, think time); 0.01 waits 9 s for 15 min."""
    seed: int = 0
    split: Split = "train"
    concurrency: int = 8
    """Most requests (completions and feedback) in flight at once."""
    zh_share: float = 0.3
    privacy_share: float = 0.1
    max_tokens: int | None = None
    """Tokens per answer; default 48 for one-turn answers, 96 for an agent's turns."""
    agent: bool = False
    """Agent sessions: each task is a run of tool calls in a workspace (`sandbox.agent_tasks`)."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """The IDE client the developers use, and what it reports (`sandbox.simulator.clients`)."""
    request_timeout_s: float = 60.0
    max_wall_s: float | None = None
    """Hard limit on the run; open sessions are cut. Default: none when bounded by count,
    else the duration plus the survival horizon (scaled) plus two request timeouts."""

    def __post_init__(self) -> None:
        positive = {
            "users": self.users,
            "tasks_per_session": self.tasks_per_session,
            "concurrency": self.concurrency,
            "max_tokens": self.max_tokens,
            "request_timeout_s": self.request_timeout_s,
            "sessions_per_user": self.sessions_per_user,
            "duration_s": self.duration_s,
            "rate": self.rate,
            "max_wall_s": self.max_wall_s,
        }
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if self.time_scale < 0:
            raise ValueError("time_scale cannot be negative")
        if self.split not in ("all", "train", "heldout"):
            raise ValueError(f"split must be all, train or heldout, not {self.split!r}")

    @property
    def answer_tokens(self) -> int:
        return self.max_tokens or (96 if self.agent else 48)

    @property
    def session_numbers(self) -> Iterable[int]:
        """The numbers of the sessions each developer runs (endless when bounded by time)."""
        if self.sessions_per_user is not None:
            return range(self.sessions_per_user)
        return itertools.count() if self.duration_s is not None else range(1)

    @property
    def time_limit_s(self) -> float | None:
        if self.max_wall_s is not None or self.duration_s is None:
            return self.max_wall_s
        horizon_s = SURVIVAL_WINDOWS_S[-1] * self.time_scale
        return self.duration_s + horizon_s + 2 * self.request_timeout_s


def compressed_time_settings(settings: Settings, time_scale: float) -> Settings:
    """The settings of a stack that serves developers simulated at `time_scale` (< 1).

    A simulated developer reports the share of an edit kept 15 minutes on after 900 ×
    `time_scale` real seconds. The workers leave out a survival report that claims more time
    since the acceptance than had passed, beyond `feedback_clock_skew` (60 s), as never
    measured; under compressed time the skew is widened by the whole horizon so that those
    reports count. A production stack keeps its 60 s.
    """
    if time_scale >= 1:
        return settings
    skew = settings.feedback_clock_skew + timedelta(seconds=SURVIVAL_WINDOWS_S[-1])
    return settings.model_copy(update={"feedback_clock_skew": skew})


class Pacer:
    """Spaces session starts at least `1 / rate` seconds apart."""

    def __init__(self, rate: float | None) -> None:
        self.interval_s = 1.0 / rate if rate else 0.0
        self.next_start = 0.0

    async def wait(self) -> None:
        if not self.interval_s:
            return
        now = time.monotonic()
        start = max(self.next_start, now)
        self.next_start = start + self.interval_s
        await asyncio.sleep(start - now)


def simulate(
    gateway_url: str,
    api_key: str,
    *,
    users: int = 10,
    sessions_per_user: int | None = None,
    duration_s: float | None = None,
    rate: float | None = None,
    tasks_per_session: int = 5,
    time_scale: float = 1.0,
    seed: int = 0,
    split: Split = "train",
    concurrency: int = 8,
    zh_share: float = 0.3,
    privacy_share: float = 0.1,
    max_wall_s: float | None = None,
    agent: bool = False,
    client: ClientConfig | None = None,
    progress: Progress | None = None,
) -> SimulationReport:
    """Run a population of developers against the gateway until done; see `Workload`."""
    workload = Workload(
        users=users,
        sessions_per_user=sessions_per_user,
        duration_s=duration_s,
        rate=rate,
        tasks_per_session=tasks_per_session,
        time_scale=time_scale,
        seed=seed,
        split=split,
        concurrency=concurrency,
        zh_share=zh_share,
        privacy_share=privacy_share,
        max_wall_s=max_wall_s,
        agent=agent,
        client=client or ClientConfig(),
    )
    return asyncio.run(run_simulation(gateway_url, api_key, workload, progress=progress))


async def run_simulation(
    gateway_url: str, api_key: str, workload: Workload, *, progress: Progress | None = None
) -> SimulationReport:
    """`simulate` for callers already inside an event loop."""
    report = SimulationReport(client=workload.client.mode)
    started = time.monotonic()
    gateway = GatewayClient(
        gateway_url,
        api_key,
        report,
        concurrency=workload.concurrency,
        timeout_s=workload.request_timeout_s,
        max_tokens=workload.answer_tokens,
        client=workload.client.mode,
    )
    runner = _Runner(workload, gateway, report, progress)
    try:
        await runner.run()
    finally:
        await gateway.aclose()
        report.wall_s = time.monotonic() - started
    return report


class _Runner:
    """Each developer's sessions one after another, all developers at once."""

    def __init__(
        self,
        workload: Workload,
        gateway: GatewayClient,
        report: SimulationReport,
        progress: Progress | None,
    ) -> None:
        self.workload, self.gateway, self.report = workload, gateway, report
        self.progress = progress
        self.started = 0.0
        self.pacer = Pacer(workload.rate)
        self.sessions: list[DeveloperSession] = []
        self.closing: list[asyncio.Task[None]] = []
        tasks = all_tasks(workload.split)
        self.tasks_by_language: dict[str, list[Task]] = {
            language: [task for task in tasks if task.language == language]
            for language in ("en", "zh")
        }

    def keep_going(self) -> bool:
        duration_s = self.workload.duration_s
        return duration_s is None or time.monotonic() - self.started < duration_s

    async def run(self) -> None:
        workload = self.workload
        self.started = time.monotonic()
        developers = make_population(
            workload.users,
            workload.seed,
            zh_share=workload.zh_share,
            privacy_share=workload.privacy_share,
        )
        days = [asyncio.create_task(self.developer_day(developer)) for developer in developers]
        try:
            await asyncio.wait_for(self._finish(days), timeout=workload.time_limit_s)
        except TimeoutError:
            for task in days + self.closing:
                task.cancel()
            for session in self.sessions:
                session.cancel()
            await asyncio.gather(*days, *self.closing, return_exceptions=True)
            self.report.sessions_cut = sum(not session.closed for session in self.sessions)

    async def _finish(self, days: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*days)
        await asyncio.gather(*self.closing)

    async def developer_day(self, developer: Developer) -> None:
        workload = self.workload
        for number in workload.session_numbers:
            if number:
                await asyncio.sleep(developer.think_time_s * workload.time_scale)
            await self.pacer.wait()
            if not self.keep_going():
                return
            rng = random.Random(f"rtrl-simulator:{workload.seed}:{developer.user_id}:{number}")
            tasks = pick_tasks(developer, self.tasks_by_language, workload.tasks_per_session, rng)
            ide = ide_for_session(workload.client, developer, number)
            session = (
                AgentSession(
                    self.gateway,
                    self.report,
                    developer,
                    [agent_task(task, rng) for task in tasks],
                    time_scale=workload.time_scale,
                    rng=rng,
                    ide=ide,
                )
                if workload.agent
                else DeveloperSession(
                    self.gateway,
                    self.report,
                    developer,
                    tasks,
                    time_scale=workload.time_scale,
                    rng=rng,
                    ide=ide,
                )
            )
            self.sessions.append(session)
            await session.work(self.keep_going)
            self.closing.append(asyncio.create_task(self._close(session)))

    async def _close(self, session: DeveloperSession) -> None:
        await session.close()
        if self.progress is not None:
            self.progress(self.report)
