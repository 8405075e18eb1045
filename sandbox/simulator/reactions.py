"""What a developer does after an answer: judge the edit, keep it or not, say something.

Pure functions of the task, the answer text, its latency and the developer, so the
simulator's behaviour is testable without a gateway.

The latency rule, against the developer's `patience_s`:
- latency <= patience: the developer reacts to the answer only;
- patience < latency <= ABANDON_FACTOR x patience: same verdict, and the follow-up opens
  with an impatient remark ("took a while.", "好慢啊。");
- latency > ABANDON_FACTOR x patience: the developer gives up on the session before
  reading the answer: no verdict, no follow-up, no further tasks; the session still ends
  with `session_end`, so the unjudged completion is finalized (kept unknown counts 0).
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass, replace

from app.events import (
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
)
from sandbox.simulator.followups import Failure, complaint, impatient_remark, moving_on
from sandbox.simulator.population import Developer
from sandbox.tasks import Task, check_solution, extract_code

Feedback = EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd

SURVIVAL_WINDOWS_S = (30.0, 120.0, 300.0, 600.0, 900.0)
"""When an IDE reports how much of an accepted edit is still there (Copilot, Cody, VS Code)."""
ABANDON_FACTOR = 3.0
MIN_KEPT_SHARE = 0.9
"""A passing edit is only ever touched up: at least this share of it survives."""


@dataclass(frozen=True)
class Reaction:
    """A developer's response to one answer, before it becomes events."""

    proposed_edit: bool
    accepted: bool | None
    """None when the developer abandoned the session before judging the answer."""
    survival: tuple[tuple[float, float], ...]
    """(elapsed_s, surviving_share) reports after an acceptance, in time order."""
    followup: str | None
    impatient: bool
    abandons_session: bool


def diagnose(task: Task, answer_text: str) -> Failure | None:
    """Why the answer fails the task's hidden checks, or None when it passes them."""
    code = extract_code(answer_text)
    if code is None:
        return Failure("no_code")
    if check_solution(task, code):
        return None
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        lines = code.splitlines()
        line = lines[exc.lineno - 1] if exc.lineno and exc.lineno <= len(lines) else ""
        return Failure("syntax_error", line=line)
    except (ValueError, RecursionError, MemoryError):
        return Failure("syntax_error")
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    if task.function_name not in defined:
        return Failure("wrong_name")
    for argument, expected in task.checks:
        if not check_solution(replace(task, checks=((argument, expected),)), code):
            return Failure("wrong_result", argument, expected)
    argument, expected = task.checks[0]
    return Failure("wrong_result", argument, expected)


def survival_shares(developer: Developer, rng: random.Random) -> tuple[float, ...]:
    """Share of a passing edit left at each window: starts whole, only touched up after."""
    share, shares = 1.0, []
    for _ in SURVIVAL_WINDOWS_S:
        if rng.random() < developer.tweak_rate:
            share = max(MIN_KEPT_SHARE, share - rng.uniform(0.0, 0.04))
        shares.append(round(share, 3))
    return tuple(shares)


def react(
    task: Task, answer_text: str, latency_s: float, developer: Developer, rng: random.Random
) -> Reaction:
    """How `developer` responds to `answer_text`, which took `latency_s` to arrive."""
    proposed_edit = extract_code(answer_text) is not None
    if latency_s > ABANDON_FACTOR * developer.patience_s:
        return Reaction(proposed_edit, None, (), None, impatient=True, abandons_session=True)
    failure = diagnose(task, answer_text)
    if failure is None:
        shares = survival_shares(developer, rng)
        survival = tuple(zip(SURVIVAL_WINDOWS_S, shares, strict=True))
        followup = moving_on(task, rng)
    else:
        survival = ()
        followup = complaint(task, failure, rng)
    impatient = latency_s > developer.patience_s
    if impatient:
        followup = f"{impatient_remark(task.language, rng)} {followup}"
    return Reaction(
        proposed_edit,
        accepted=failure is None,
        survival=survival,
        followup=followup,
        impatient=impatient,
        abandons_session=False,
    )


def feedback_events(reaction: Reaction, session_id: str, request_id: str) -> list[Feedback]:
    """The IDE events a reaction produces, in the order they fall due (see `due_after_s`)."""
    ids = {"session_id": session_id, "request_id": request_id}
    events: list[Feedback] = []
    if reaction.accepted is not None:
        events.append(EditAccepted(**ids) if reaction.accepted else EditRejected(**ids))
    if reaction.followup is not None:
        events.append(FollowupMessage(**ids, message=reaction.followup))
    events += [
        EditSurvival(**ids, elapsed_s=elapsed_s, surviving_share=share)
        for elapsed_s, share in reaction.survival
    ]
    return events


def due_after_s(event: Feedback) -> float:
    """Real seconds after the answer at which the IDE reports `event`."""
    return event.elapsed_s if isinstance(event, EditSurvival) else 0.0
