"""What a simulated developer sends after an answer: verdict, survival, follow-up, latency."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from app.events import EditSurvival, FollowupMessage, feedback_adapter
from app.signals.followup import is_dissatisfied
from sandbox.simulator.population import make_population
from sandbox.simulator.reactions import (
    ABANDON_FACTOR,
    SURVIVAL_WINDOWS_S,
    diagnose,
    due_after_s,
    feedback_events,
    react,
)
from sandbox.tasks import OPERATIONS_BY_NAME, Task, all_tasks, format_response, reference_code

TASKS = all_tasks()
DEVELOPER = replace(make_population(1, seed=0)[0], patience_s=5.0)


def a_task(operation: str = "times", language: str = "en") -> Task:
    return next(t for t in TASKS if t.operation == operation and t.language == language)


def wrong_answer(task: Task, rng: random.Random) -> str:
    """An answer that fails the task the way small models fail: wrong op, name, syntax, prose."""
    kind = rng.choice(("operation", "operation", "name", "syntax", "prose"))
    if kind == "prose":
        return rng.choice(("Sure! Here you go.", "我来帮你写这个函数。"))
    if kind == "syntax":
        return format_response(f"def {task.function_name}(x)\n    return x +\n")
    name = "k" if kind == "name" else task.function_name
    others = [o for o in OPERATIONS_BY_NAME.values() if o.name != task.operation]
    operation = OPERATIONS_BY_NAME[task.operation] if kind == "name" else rng.choice(others)
    return format_response(reference_code(name, operation.expression, task.constant))


def kinds(events: list) -> list[str]:
    return [event.kind for event in events]


def test_a_passing_answer_is_accepted_survives_and_the_developer_moves_on() -> None:
    task = a_task()
    reaction = react(task, format_response(task.reference), 0.2, DEVELOPER, random.Random(1))
    events = feedback_events(reaction, "s-1", "r-1")

    assert kinds(events) == ["edit_accepted", "followup_message"] + ["edit_survival"] * 5
    survival = [event for event in events if isinstance(event, EditSurvival)]
    assert [event.elapsed_s for event in survival] == [30, 120, 300, 600, 900]
    shares = [event.surviving_share for event in survival]
    assert shares == sorted(shares, reverse=True)
    assert all(0.9 <= share <= 1.0 for share in shares)
    followup = events[1]
    assert isinstance(followup, FollowupMessage) and followup.message
    assert not is_dissatisfied(followup.message)
    assert all(event.session_id == "s-1" and event.request_id == "r-1" for event in events)


def test_passing_edits_are_touched_up_now_and_then() -> None:
    task = a_task("plus", "zh")
    rng = random.Random(2)
    horizon_shares = {
        react(task, format_response(task.reference), 0.1, DEVELOPER, rng).survival[-1][1]
        for _ in range(200)
    }
    assert len(horizon_shares) > 20
    assert 1.0 in horizon_shares
    assert min(horizon_shares) >= 0.9


def test_a_failing_answer_is_rejected_with_a_complaint() -> None:
    task = a_task("minus")
    answer = format_response(reference_code("f", "x + {c}", task.constant))
    events = feedback_events(react(task, answer, 0.1, DEVELOPER, random.Random(3)), "s", "r")
    assert kinds(events) == ["edit_rejected", "followup_message"]


def test_an_answer_without_code_is_rejected() -> None:
    reaction = react(a_task(), "Sure, I can help with that.", 0.1, DEVELOPER, random.Random(4))
    assert not reaction.proposed_edit
    assert kinds(feedback_events(reaction, "s", "r")) == ["edit_rejected", "followup_message"]


def test_most_complaints_are_recognised_by_the_workers_classifier() -> None:
    rng = random.Random(5)
    messages = []
    for task in rng.sample(TASKS, 400):
        reaction = react(task, wrong_answer(task, rng), 0.1, DEVELOPER, rng)
        assert reaction.accepted is False
        assert reaction.followup is not None
        messages.append(reaction.followup)
    flagged = sum(is_dissatisfied(message) for message in messages) / len(messages)
    assert flagged >= 0.8
    assert flagged < 1.0, "people are not always explicit; neither is the simulation"
    assert len(set(messages)) > 100
    assert any("Traceback" in m or "FAILED" in m or "SyntaxError" in m for m in messages)
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in m) for m in messages)


def test_the_complaint_names_the_first_input_the_function_gets_wrong() -> None:
    task = a_task("larger")  # max(x, c); the answer returns x, wrong wherever x < c
    failure = diagnose(task, format_response(reference_code("f", "x", task.constant)))
    assert failure is not None and failure.kind == "wrong_result"
    assert failure.argument is not None and failure.argument < task.constant
    assert failure.expected == task.constant
    assert diagnose(task, format_response(task.reference)) is None
    no_code = diagnose(task, "Sure, I can help with that.")
    assert no_code is not None and no_code.kind == "no_code"


def test_a_slow_answer_gets_an_impatient_remark_and_the_same_verdict() -> None:
    task = a_task()
    answer = format_response(task.reference)
    slow_s = DEVELOPER.patience_s * 1.5
    prompt = react(task, answer, DEVELOPER.patience_s, DEVELOPER, random.Random(6))
    slow = react(task, answer, slow_s, DEVELOPER, random.Random(6))

    assert not prompt.impatient and slow.impatient
    assert slow.accepted is prompt.accepted is True
    assert slow.followup is not None and prompt.followup is not None
    assert slow.followup != prompt.followup and slow.followup.endswith(prompt.followup)
    assert not slow.abandons_session


def test_a_far_too_slow_answer_makes_the_developer_abandon_the_session() -> None:
    task = a_task()
    far_too_slow_s = DEVELOPER.patience_s * ABANDON_FACTOR + 0.01
    reaction = react(
        task, format_response(task.reference), far_too_slow_s, DEVELOPER, random.Random(7)
    )
    assert reaction.abandons_session
    assert reaction.accepted is None and reaction.followup is None
    assert feedback_events(reaction, "s", "r") == []


@pytest.mark.parametrize("passing", [True, False])
def test_every_event_is_valid_on_the_wire_and_due_in_order(passing: bool) -> None:
    task = a_task("distance", "zh")
    answer = format_response(task.reference if passing else reference_code("f", "x", 2))
    events = feedback_events(react(task, answer, 0.1, DEVELOPER, random.Random(8)), "s", "r")
    for event in events:
        assert feedback_adapter.validate_json(event.model_dump_json()) == event
    due = [due_after_s(event) for event in events]
    assert due == sorted(due)
    assert [d for d in due if d] == (list(SURVIVAL_WINDOWS_S) if passing else [])
