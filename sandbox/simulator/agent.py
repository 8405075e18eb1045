"""One developer's agent session: each task is an agent run in a workspace, then judged.

The simulated IDE declares the workspace's tools, runs every call of the model's that it can
(`sandbox.simulator.toolcalls`) in the task's workspace and sends the result back as the next
request's tool message, until the model answers without a call (its final answer) or the run
reaches `MAX_TURNS`. The developer then judges the file the run left behind with the task's
hidden checks. The ideal client reports accept or reject, the edit's survival over time and a
follow-up — on the run's last turn, the answer the IDE shows them. Continue reports a
`toolUsage` per call the IDE ran, with the developer's verdict on the edits they looked at
(an edit approved without a look is applied all the same, and reported by nothing), and a
thumbs up or down on the final answer. A stock client reports nothing.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.events import EditRejected, utcnow
from sandbox.agent_tasks import MAX_TURNS, TOOLS, AgentTask, Workspace
from sandbox.simulator.clients import Ide
from sandbox.simulator.continue_events import tool_usage
from sandbox.simulator.gateway import GatewayClient
from sandbox.simulator.population import Developer
from sandbox.simulator.reactions import Feedback, Reaction, feedback_events, react
from sandbox.simulator.renderings import RENDERINGS, rendered_result
from sandbox.simulator.report import AgentRun, EditOutcome, ServedRequest, SimulationReport
from sandbox.simulator.session import DeveloperSession
from sandbox.simulator.toolcalls import IdeToolCall, read_tool_call, unread_tool_calls
from sandbox.tasks import format_response


@dataclass(frozen=True)
class ExecutedCall:
    """A tool call of one turn, and what the IDE got running it."""

    request_id: str
    call: IdeToolCall
    output: str
    """The tool message the model reads next turn."""
    succeeded: bool
    """The call ran, and an edit changed the file."""
    outcome: EditOutcome | None = None
    """A stock agent's edit call: applied, refused at the permission prompt, or unapplicable."""


def execute(
    workspace: Workspace, task: AgentTask, request_id: str, call: IdeToolCall
) -> ExecutedCall:
    """Run `call` in the workspace, or answer it with why the IDE could not."""
    if not call.runnable:
        return ExecutedCall(request_id, call, f"error: {call.problem}", succeeded=False)
    edits_before = workspace.edits
    output, _ = workspace.run(task, call.name, call.arguments)
    succeeded = workspace.edits > edits_before if call.edits else not output.startswith("error")
    return ExecutedCall(request_id, call, output, succeeded)


@dataclass
class RunTrace:
    """One agent run as the IDE saw it, turn by turn (a turn is named by its request id)."""

    session_id: str
    """The session the gateway filed the run under."""
    turns: list[str] = field(default_factory=list)
    malformed: dict[str, int] = field(default_factory=dict)
    """Calls the IDE could not run, by turn."""
    executed: list[ExecutedCall] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    """Turns whose edit changed the file: the run's diff the developer judges."""
    not_applied: list[str] = field(default_factory=list)
    """Turns that called an edit tool the workspace could not apply."""
    checkpoint: str = ""
    latency_s: float = 0.0
    """The slowest turn's latency: what the developer noticed."""
    final_text: str = ""
    """The answer without a call that ended the run; empty when `MAX_TURNS` ended it."""
    calls: int = 0
    clarifying: bool = False
    """The run's first answer asked a question instead of acting."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as the IDE last sent it, and the run's last answer."""
    outcomes: dict[str, list[EditOutcome]] = field(default_factory=dict)
    """A stock agent's edit calls, by turn: what became of each (ground truth)."""

    def outcome(self, request_id: str) -> EditOutcome | None:
        """What became of the turn's edit: applied wins, then refused, then unapplicable."""
        order: tuple[EditOutcome, ...] = ("applied", "refused", "unapplicable")
        seen = self.outcomes.get(request_id, [])
        return next((outcome for outcome in order if outcome in seen), None)

    @property
    def judged(self) -> list[str]:
        """The turns the developer's verdict is about: the edit turns, else the last turn."""
        return self.applied or self.turns[-1:]


def ideal_feedback(trace: RunTrace, reaction: Reaction) -> list[Feedback]:
    """What the ideal IDE reports of a run: the developer's verdict on the run's diff (accept
    or reject, then how much of it survives) on every turn whose edit is part of it, the
    follow-up on the last of them (or on the final answer when nothing was edited), and an
    edit the workspace could not apply as rejected: each edit turn's fate is known, once (a
    run that ended on such a turn with nothing applied is judged there by its follow-up
    alone)."""
    events: list[Feedback] = [
        EditRejected(session_id=trace.session_id, request_id=r) for r in trace.not_applied
    ]
    judged = trace.judged
    for request_id in judged:
        verdict = replace(reaction, followup=None) if request_id != judged[-1] else reaction
        if request_id in trace.not_applied:
            verdict = replace(verdict, accepted=None, survival=())
        events += feedback_events(verdict, trace.session_id, request_id)
    return events


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
        ide: Ide | None = None,
    ) -> None:
        super().__init__(gateway, report, developer, (), time_scale=time_scale, rng=rng, ide=ide)
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
        trace = await self._agent_loop(task, index, workspace)
        if not trace.turns:
            return None
        # What the developer sees: the file the run left behind, or the final answer.
        shown = format_response(workspace.final_code(task)) if workspace.edits else trace.final_text
        reaction = react(task.task, shown, trace.latency_s, self.developer, self.rng)
        continue_events, told = (
            self._continue_tool_usage(trace.executed, reaction)
            if self.ide.mode == "continue"
            else ([], set())
        )
        # A stock agent's conversation goes on after the run: the developer answers its final
        # answer, or stops it at the turn limit with the last calls' results sent.
        told_next = self.ide.rendered is not None and (
            bool(trace.final_text) or len(trace.turns) == MAX_TURNS
        )
        for request_id in trace.turns:
            final = told_next and bool(trace.final_text) and request_id == trace.turns[-1]
            self.report.record_served(
                ServedRequest(
                    request_id=request_id,
                    session_id=trace.session_id,
                    user_id=self.developer.user_id,
                    task_id=task.task_id,
                    checkpoint=trace.checkpoint,
                    latency_s=trace.latency_s,
                    proposed_edit=request_id in trace.applied,
                    accepted=reaction.accepted if request_id in trace.judged else None,
                    verdict_reported=self.ide.mode == "ideal" or request_id in told,
                    malformed_calls=trace.malformed[request_id],
                    edit_outcome=trace.outcome(request_id),
                    followup_dissatisfied=(reaction.accepted is False) if final else None,
                )
            )
        answered_at = time.monotonic()
        self.last_request_id = trace.turns[-1]
        if told_next and reaction.followup is not None:
            await self._tell_next(task, index, trace, reaction.followup)
        if self.ide.mode == "ideal":
            await self.report_feedback(ideal_feedback(trace, reaction), answered_at)
        elif self.ide.mode == "continue":
            for event in continue_events:
                await self.gateway.post_continue_event(self.developer, event)
            await self.rate_answer(reaction, task.request, trace.final_text)
        run = AgentRun(
            user_id=self.developer.user_id,
            checkpoint=trace.checkpoint,
            task_id=task.task_id,
            turns=len(trace.turns),
            edited=workspace.edits > 0,
            solved=workspace.solves(task),
            accepted=reaction.accepted,
            tool_calls=trace.calls,
            malformed_calls=sum(trace.malformed.values()),
            clarifying_question=trace.clarifying,
            read_before_edit=workspace.read_before_edit,
            abandoned=reaction.abandons_session,
        )
        self.report.record_run(run)
        return run

    async def _agent_loop(self, task: AgentTask, index: int, workspace: Workspace) -> RunTrace:
        """Ask, run the calls, send their results back, until a final answer or `MAX_TURNS`."""
        trace = RunTrace(self.session_id)
        messages = trace.messages
        messages.append({"role": "user", "content": task.request})
        for turn in range(MAX_TURNS):
            answer = await self.gateway.ask(
                self.developer,
                self.session_id,
                f"{self.session_id}.{index}.{turn}",
                messages,
                tools=TOOLS,
            )
            if answer is None:
                break
            request_id, trace.session_id = answer.request_id, answer.session_id
            trace.turns.append(request_id)
            trace.checkpoint = answer.checkpoint
            trace.latency_s = max(trace.latency_s, answer.latency_s)
            unread = unread_tool_calls(answer.text)
            tool_calls = [read_tool_call(call) for call in answer.tool_calls]
            trace.malformed[request_id] = unread + sum(not call.runnable for call in tool_calls)
            trace.calls += unread + len(tool_calls)
            assistant: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
            if answer.tool_calls:
                assistant["tool_calls"] = list(answer.tool_calls)
            messages.append(assistant)
            if not tool_calls:
                trace.final_text = answer.text
                question = answer.text.rstrip().endswith(("?", "？"))
                trace.clarifying = turn == 0 and not unread and question
                break
            edits_before = workspace.edits
            refusal: ExecutedCall | None = None
            for call in tool_calls:
                # A stock agent stops at a refusal: the calls after it are not run.
                if refusal is not None:
                    done = refusal
                else:
                    done = self._at_the_ide(workspace, task, request_id, call)
                    if done.outcome is not None:
                        trace.outcomes.setdefault(request_id, []).append(done.outcome)
                if done.outcome == "refused":
                    refusal = done
                else:
                    trace.executed.append(done)
                messages.append(
                    {"role": "tool", "tool_call_id": call.call_id, "content": done.output}
                )
            if workspace.edits > edits_before:
                trace.applied.append(request_id)
            elif any(call.edits for call in tool_calls):
                trace.not_applied.append(request_id)
            if refusal is not None:
                messages.append({"role": "user", "content": self._after_refusal(task, workspace)})
        return trace

    async def _tell_next(self, task: AgentTask, index: int, trace: RunTrace, words: str) -> None:
        """A stock agent's user answers its final answer (or stops it at the turn limit) in
        the same conversation: their next message, after the last calls' results if any,
        served as the next turn (which nobody judges: the task ends there)."""
        messages = [*trace.messages, {"role": "user", "content": words}]
        request_id = f"{self.session_id}.{index}.next"
        answer = await self.gateway.ask(
            self.developer, self.session_id, request_id, messages, tools=TOOLS
        )
        if answer is None:
            return
        self.last_request_id = answer.request_id
        self.report.record_served(
            ServedRequest(
                request_id=answer.request_id,
                session_id=answer.session_id,
                user_id=self.developer.user_id,
                task_id=task.task_id,
                checkpoint=answer.checkpoint,
                latency_s=answer.latency_s,
                proposed_edit=False,
                accepted=None,
                verdict_reported=False,
            )
        )

    def _at_the_ide(
        self,
        workspace: Workspace,
        task: AgentTask,
        request_id: str,
        call: IdeToolCall,
    ) -> ExecutedCall:
        """Run `call` as the IDE does. A stock agent asks the developer before an edit that
        would apply (they approve one after which the file passes more readily), and words
        the result as that client does; the edit's fate (`outcome`) is the ground truth."""
        client = self.ide.rendered
        if client is None or not call.edits:
            return execute(workspace, task, request_id, call)
        if not call.runnable:
            # The client refuses a malformed edit with the tool's error: not applied.
            return replace(execute(workspace, task, request_id, call), outcome="unapplicable")
        trial = copy.deepcopy(workspace)
        would = execute(trial, task, request_id, call)
        outcome: EditOutcome = "unapplicable"
        if would.succeeded:
            outcome = "applied" if self.ide.approves(trial.solves(task)) else "refused"
        done = execute(workspace, task, request_id, call) if outcome != "refused" else would
        arguments = call.parsed or {}
        output = rendered_result(
            client,
            outcome,
            path=str(arguments.get("path", "")),
            old=str(arguments.get("old_string", "")),
            tool_output=done.output,
        )
        return replace(done, output=output, succeeded=outcome == "applied", outcome=outcome)

    def _after_refusal(self, task: AgentTask, workspace: Workspace) -> str:
        """The user message a stock agent sends after a refusal: its marker, if it writes one,
        then the developer's words on the file as it stands."""
        shown = format_response(workspace.final_code(task))
        words = react(task.task, shown, 0.0, self.developer, self.rng).followup or ""
        client = self.ide.rendered
        marker = RENDERINGS[client].after_refusal if client is not None else None
        return f"{marker}\n{words}" if marker else words

    def _continue_tool_usage(
        self, executed: Sequence[ExecutedCall], reaction: Reaction
    ) -> tuple[list[dict[str, Any]], set[str]]:
        """Continue's `toolUsage` events of a run, and the turns whose edit verdict they tell.

        Calls that need no approval (reads, tests, calls the IDE could not run) are reported
        as run; an edit carries the developer's verdict on the run's diff when they looked at
        it, and is reported by nothing when they approved it without a look (or left before
        judging). A refused edit did not succeed.
        """
        events: list[dict[str, Any]] = []
        told: set[str] = set()
        for done in executed:
            accepted = True
            if done.call.edits and done.call.runnable:
                if reaction.accepted is None or not self.ide.looks_at_edit():
                    continue
                accepted = reaction.accepted
            event = tool_usage(
                done.call,
                output=done.output,
                accepted=accepted,
                succeeded=accepted and done.succeeded,
                user_id=self.developer.user_id,
                destination=self.ide.destination,
                at=utcnow(),
            )
            if event is not None:
                events.append(event)
                if done.call.edits:
                    told.add(done.request_id)
        return events, told
