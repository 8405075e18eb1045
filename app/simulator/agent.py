"""One developer's agent session: each task is an agent run in a workspace, then judged.

The simulated IDE declares the workspace's tools, runs every call the model makes in the
task's workspace and sends the result back as the next request's tool message, until the
model answers without a call (its final answer) or the run reaches `MAX_TURNS`. The
developer then judges the file the run left behind with the task's hidden checks, and
reports accept or reject, the edit's survival over time and a follow-up — on the run's last
turn, the answer the IDE shows them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from app.agent_tasks import MAX_TURNS, TOOLS, AgentTask, Workspace
from app.events import EditRejected
from app.gateway.toolcalls import is_edit_tool, unread_tool_calls
from app.simulator.gateway import GatewayClient
from app.simulator.population import Developer
from app.simulator.reactions import Feedback, due_after_s, feedback_events, react
from app.simulator.report import AgentRun, ServedRequest, SimulationReport
from app.simulator.session import DeveloperSession
from app.tasks import format_response


class AgentSession(DeveloperSession):
    """A session of agent runs; `close` (inherited) ends it once the reports are sent."""

    def __init__(
        self,
        gateway: GatewayClient,
        report: SimulationReport,
        developer: Developer,
        tasks: Sequence[AgentTask],
        *,
        time_scale: float,
        rng: random.Random,
    ) -> None:
        super().__init__(gateway, report, developer, (), time_scale=time_scale, rng=rng)
        self.agent_tasks = tasks

    async def work(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Run each task's agent loop and report the developer's reaction to the result."""
        self.report.sessions_started += 1
        for index, task in enumerate(self.agent_tasks):
            if index:
                if not keep_going():
                    return
                await asyncio.sleep(self.developer.think_time_s * self.time_scale)
            run = await self._run(task, index)
            if run is None:
                continue
            if run.abandoned:
                self.report.sessions_abandoned += 1
                return

    async def _run(self, task: AgentTask, index: int) -> AgentRun | None:
        workspace = Workspace.for_task(task)
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.request}]
        turns: list[str] = []
        applied: list[str] = []
        """Turns whose edit changed the file: the run's diff the developer judges."""
        not_applied: list[str] = []
        """Turns that called an edit tool the workspace could not apply."""
        checkpoint, latency_s, final_text = "", 0.0, ""
        malformed = calls = 0
        clarifying = False
        for turn in range(MAX_TURNS):
            request_id = f"{self.session_id}.{index}.{turn}"
            answer = await self.gateway.ask(
                self.developer, self.session_id, request_id, messages, tools=TOOLS
            )
            if answer is None:
                break
            turns.append(request_id)
            checkpoint, latency_s = answer.checkpoint, max(latency_s, answer.latency_s)
            unread = unread_tool_calls(answer.text)
            malformed += unread
            calls += unread + len(answer.tool_calls)
            assistant: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
            if answer.tool_calls:
                assistant["tool_calls"] = list(answer.tool_calls)
            messages.append(assistant)
            if not answer.tool_calls:
                final_text = answer.text
                clarifying = turn == 0 and not unread and answer.text.rstrip().endswith(("?", "？"))
                break
            edits_before = workspace.edits
            edit_called = False
            for call in answer.tool_calls:
                function = call.get("function") or {}
                edit_called |= is_edit_tool(function.get("name"))
                result, well_formed = workspace.run(
                    task, function.get("name"), function.get("arguments")
                )
                malformed += not well_formed
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            if workspace.edits > edits_before:
                applied.append(request_id)
            elif edit_called:
                not_applied.append(request_id)
        if not turns:
            return None
        # What the developer sees: the file the run left behind, or the final answer.
        shown = format_response(workspace.final_code(task)) if workspace.edits else final_text
        reaction = react(task.task, shown, latency_s, self.developer, self.rng)
        # The IDE reports the developer's verdict on the run's diff (accept or reject, then
        # how much of it survives) on every turn whose edit is part of it, the follow-up on
        # the last of them (or on the final answer when nothing was edited), and an edit the
        # workspace could not apply as rejected: each edit turn's fate is known.
        judged = applied or [turns[-1]]
        for request_id in turns:
            self.report.record_served(
                ServedRequest(
                    request_id=request_id,
                    session_id=self.session_id,
                    user_id=self.developer.user_id,
                    task_id=task.task_id,
                    checkpoint=checkpoint,
                    latency_s=latency_s,
                    proposed_edit=request_id in applied,
                    accepted=reaction.accepted if request_id in judged else None,
                )
            )
        answered_at = time.monotonic()
        self.last_request_id = turns[-1]
        events: list[Feedback] = [
            EditRejected(session_id=self.session_id, request_id=r) for r in not_applied
        ]
        for request_id in judged:
            verdict = replace(reaction, followup=None) if request_id != judged[-1] else reaction
            events += feedback_events(verdict, self.session_id, request_id)
        immediate = [event for event in events if due_after_s(event) == 0]
        later = sorted((event for event in events if due_after_s(event) > 0), key=due_after_s)
        if immediate:
            await self.gateway.send_feedback(self.developer, immediate)
        if later:
            self.survival_timers.append(asyncio.create_task(self._report_later(later, answered_at)))
        run = AgentRun(
            user_id=self.developer.user_id,
            checkpoint=checkpoint,
            task_id=task.task_id,
            turns=len(turns),
            edited=workspace.edits > 0,
            solved=workspace.solves(task),
            accepted=reaction.accepted,
            tool_calls=calls,
            malformed_calls=malformed,
            clarifying_question=clarifying,
            read_before_edit=workspace.read_before_edit,
            abandoned=reaction.abandons_session,
        )
        self.report.record_run(run)
        return run
