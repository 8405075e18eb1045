"""One developer's IDE session: a few coding tasks, what the IDE reports of each, its end."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable, Sequence

from app.events import EditSurvival, SessionEnd, utcnow
from sandbox.simulator.clients import IDE_CLOSED_BEFORE_S, Ide, ideal_ide
from sandbox.simulator.continue_events import chat_feedback
from sandbox.simulator.gateway import GatewayClient
from sandbox.simulator.population import Developer
from sandbox.simulator.reactions import Feedback, Reaction, due_after_s, feedback_events, react
from sandbox.simulator.report import ServedRequest, SimulationReport
from sandbox.tasks import Task


def pick_tasks(
    developer: Developer, tasks_by_language: dict[str, list[Task]], n: int, rng: random.Random
) -> list[Task]:
    """`n` tasks, each in the developer's language unless they switch for this one."""
    other = "en" if developer.language == "zh" else "zh"
    picked = []
    for _ in range(n):
        switch = rng.random() < developer.other_language_rate
        picked.append(rng.choice(tasks_by_language[other if switch else developer.language]))
    return picked


class DeveloperSession:
    """A session's requests and reports; `work` does the tasks, `close` ends the session.

    What the IDE reports depends on its client (`sandbox.simulator.clients`). The ideal client's
    survival reports are timers that keep running while the developer moves on to the next
    task (and to their next session); its `session_end` waits for them, since the reward of a
    completion is finalized at session end.
    """

    def __init__(
        self,
        gateway: GatewayClient,
        report: SimulationReport,
        developer: Developer,
        tasks: Sequence[Task],
        *,
        time_scale: float,
        rng: random.Random,
        ide: Ide | None = None,
    ) -> None:
        self.gateway, self.report, self.developer = gateway, report, developer
        self.tasks, self.time_scale, self.rng = tasks, time_scale, rng
        self.ide = ide or ideal_ide()
        self.session_id = f"sim-{uuid.uuid4().hex[:16]}"
        self.last_request_id: str | None = None
        self.survival_timers: list[asyncio.Task[None]] = []
        self.closed = False

    async def work(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Ask for each task's edit and report the developer's reaction to the answer."""
        self.report.sessions_started += 1
        for index, task in enumerate(self.tasks):
            if index:
                if not keep_going():
                    return
                await asyncio.sleep(self.developer.think_time_s * self.time_scale)
            request_id = f"{self.session_id}.{index}"
            answer = await self.gateway.ask(
                self.developer, self.session_id, request_id, task.request
            )
            if answer is None:
                continue
            answered_at = time.monotonic()
            self.last_request_id = answer.request_id
            reaction = react(task, answer.text, answer.latency_s, self.developer, self.rng)
            self.report.record_served(
                ServedRequest(
                    request_id=answer.request_id,
                    session_id=answer.session_id,
                    user_id=self.developer.user_id,
                    task_id=task.task_id,
                    checkpoint=answer.checkpoint,
                    latency_s=answer.latency_s,
                    proposed_edit=reaction.proposed_edit,
                    accepted=reaction.accepted,
                    verdict_reported=self.ide.mode == "ideal",
                )
            )
            if self.ide.mode == "ideal":
                events = feedback_events(reaction, self.session_id, answer.request_id)
                await self.report_feedback(events, answered_at)
            elif self.ide.mode == "continue":
                await self.rate_answer(reaction, task.request, answer.text)
            if reaction.abandons_session:
                self.report.sessions_abandoned += 1
                return

    async def report_feedback(self, events: Sequence[Feedback], answered_at: float) -> None:
        """The ideal client's reports: those due now at once, survival windows when due; the
        windows after the IDE closed, never."""
        if self.ide.closes_early:
            events = [
                event
                for event in events
                if not (isinstance(event, EditSurvival) and event.elapsed_s >= IDE_CLOSED_BEFORE_S)
            ]
        immediate = [event for event in events if due_after_s(event) == 0]
        later = sorted((event for event in events if due_after_s(event) > 0), key=due_after_s)
        if immediate:
            await self.gateway.send_feedback(self.developer, immediate)
        if later:
            self.survival_timers.append(asyncio.create_task(self._report_later(later, answered_at)))

    async def rate_answer(self, reaction: Reaction, prompt: str, answer_text: str) -> None:
        """Continue: a thumbs down on an answer the developer is unhappy with, now and then a
        thumbs up on one they are happy with; nothing on an answer without text to rate."""
        if reaction.accepted is None or not answer_text:
            return
        if reaction.accepted and not self.ide.gives_thumbs_up():
            return
        event = chat_feedback(
            satisfied=reaction.accepted,
            prompt=prompt,
            completion=answer_text,
            session_id=self.ide.new_chat_session(),
            user_id=self.developer.user_id,
            destination=self.ide.destination,
            at=utcnow(),
        )
        await self.gateway.post_continue_event(self.developer, event)

    async def close(self) -> None:
        """Send the pending survival reports, then `session_end` if anything was served (the
        ideal client; the others just stop)."""
        await asyncio.gather(*self.survival_timers)
        if self.last_request_id is not None:
            if self.ide.mode != "ideal":
                self.report.sessions_ended += 1
            else:
                end = SessionEnd(session_id=self.session_id, request_id=self.last_request_id)
                if await self.gateway.send_feedback(self.developer, [end]):
                    self.report.sessions_ended += 1
        self.closed = True

    def cancel(self) -> None:
        """Stop the pending survival timers (the run is out of time)."""
        for timer in self.survival_timers:
            timer.cancel()

    async def _report_later(self, events: Sequence[Feedback], answered_at: float) -> None:
        for event in events:
            due = answered_at + due_after_s(event) * self.time_scale
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = event.model_copy(update={"occurred_at": utcnow()})
            await self.gateway.send_feedback(self.developer, [sent])
