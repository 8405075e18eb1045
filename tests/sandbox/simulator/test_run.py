"""Simulations against the real gateway: served, fed back, and the books add up."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC
from app.models import ApiKey
from app.processes import free_port
from sandbox.simulator import ClientConfig, SimulationReport, Workload, make_population, simulate

SEED = 2
"""Three patient developers (so nobody abandons), two in privacy mode, both languages."""
ReadTopic = Callable[..., list[dict[str, Any]]]


def agent_simulation(
    gateway_url: str, key: str, client: ClientConfig, *, users: int = 3
) -> SimulationReport:
    """Agent sessions of patient developers, two tasks each, nobody private."""
    return simulate(
        gateway_url,
        key,
        users=users,
        sessions_per_user=1,
        tasks_per_session=2,
        time_scale=0.001,
        seed=SEED,
        privacy_share=0.0,
        concurrency=4,
        agent=True,
        client=client,
    )


def test_a_short_simulation_is_served_and_every_signal_reaches_kafka(
    gateway_url: str, ide_key: str, read_topic: ReadTopic
) -> None:
    developers = {d.user_id: d for d in make_population(3, SEED, privacy_share=0.5)}
    progress: list[int] = []
    report = simulate(
        gateway_url,
        ide_key,
        users=3,
        sessions_per_user=1,
        tasks_per_session=2,
        time_scale=0.001,
        seed=SEED,
        privacy_share=0.5,
        concurrency=4,
        progress=lambda r: progress.append(r.sessions_ended),
    )

    # Every request was answered, and the books balance.
    assert report.errors == {}
    assert report.requests_sent == report.requests_ok == 6
    assert report.sessions_started == report.sessions_ended == 3
    assert len(set(report.served_request_ids)) == 6
    assert sum(stats.requests for stats in report.checkpoints.values()) == 6
    accepted = sum(bool(served.accepted) for served in report.served)
    assert sum(stats.accepted_edits for stats in report.checkpoints.values()) == accepted
    # One batch per answer (verdict + follow-up), one per survival report, one session end.
    assert report.feedback_batches_sent == report.feedback_batches_accepted == 6 + 5 * accepted + 3
    assert report.feedback_events_accepted == 2 * 6 + 5 * accepted + 3
    assert sorted(progress) == [1, 2, 3]

    served = {s.request_id: s for s in report.served}
    completions = read_topic(
        COMPLETIONS_TOPIC, until=lambda events: served.keys() <= {e["request_id"] for e in events}
    )
    logged = {e["request_id"]: e for e in completions if e["request_id"] in served}
    assert logged.keys() == served.keys()
    for request_id, completion in logged.items():
        assert completion["checkpoint"] == served[request_id].checkpoint
        assert completion["edit_requested"] is True
        assert completion["privacy"] is developers[served[request_id].user_id].privacy

    sessions = {s.session_id: developers[s.user_id] for s in report.served}
    feedback = read_topic(
        FEEDBACK_TOPIC,
        until=lambda events: (
            sum(e["kind"] == "session_end" and e["session_id"] in sessions for e in events) == 3
        ),
    )
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in feedback:
        if event["session_id"] in sessions:
            by_session[event["session_id"]].append(event)
    assert by_session.keys() == sessions.keys()
    for session_id, events in by_session.items():
        assert events[-1]["kind"] == "session_end", "the session ends after its survival reports"
        followups = [e for e in events if e["kind"] == "followup_message"]
        assert len(followups) == 2
        if sessions[session_id].privacy:
            assert all(f["message"] is None and f["dissatisfied"] is not None for f in followups)
        else:
            assert all(f["message"] for f in followups)
    survival = [e for e in feedback if e["kind"] == "edit_survival" and e["request_id"] in served]
    assert len(survival) == 5 * accepted


def test_an_agent_simulation_runs_each_task_as_linked_turns_and_judges_the_edit_turns(
    gateway_url: str, ide_key: str, read_topic: ReadTopic
) -> None:
    report = agent_simulation(gateway_url, ide_key, ClientConfig())

    assert report.errors == {}
    assert len(report.runs) == 6
    assert report.requests_ok == sum(run.turns for run in report.runs) == len(report.served)
    assert all(1 <= run.turns <= 6 for run in report.runs)
    served = {s.request_id: s for s in report.served}
    completions = read_topic(
        COMPLETIONS_TOPIC, until=lambda events: served.keys() <= {e["request_id"] for e in events}
    )
    logged = {e["request_id"]: e for e in completions if e["request_id"] in served}
    # The gateway links each run's turns into one trajectory, in order.
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for request_id, completion in logged.items():
        runs[request_id.rsplit(".", 1)[0]].append(completion)
    assert len(runs) == 6
    for turns in runs.values():
        turns.sort(key=lambda e: e["turn_index"])
        assert [e["turn_index"] for e in turns] == list(range(len(turns)))
        assert {e["trajectory_id"] for e in turns} == {turns[0]["request_id"]}
        assert all(e["edit_requested"] for e in turns)

    sessions = {s.session_id for s in report.served}
    feedback = read_topic(
        FEEDBACK_TOPIC,
        until=lambda events: (
            sum(e["kind"] == "session_end" and e["session_id"] in sessions for e in events) == 3
        ),
    )
    mine = [e for e in feedback if e["session_id"] in sessions and e["kind"] != "session_end"]
    assert {e["request_id"] for e in mine} <= served.keys()
    # One follow-up per run, and a verdict on every turn whose edit the developer judged.
    assert sum(e["kind"] == "followup_message" for e in mine) == 6
    verdicts = {e["request_id"] for e in mine if e["kind"] in ("edit_accepted", "edit_rejected")}
    assert {r for r, s in served.items() if s.accepted is not None} <= verdicts


def test_an_ideal_client_closed_early_never_reports_the_10_and_15_minute_windows(
    gateway_url: str, ide_key: str, read_topic: ReadTopic
) -> None:
    report = simulate(
        gateway_url,
        ide_key,
        users=3,
        sessions_per_user=1,
        tasks_per_session=2,
        time_scale=0.001,
        seed=SEED,
        privacy_share=0.0,
        client=ClientConfig(ide_closes_share=1.0),
    )

    assert report.errors == {}
    assert report.sessions_ended == 3
    accepted = sum(bool(served.accepted) for served in report.served)
    sessions = {s.session_id for s in report.served}
    feedback = read_topic(
        FEEDBACK_TOPIC,
        until=lambda events: (
            sum(e["kind"] == "session_end" and e["session_id"] in sessions for e in events) == 3
        ),
    )
    windows = [
        e["elapsed_s"]
        for e in feedback
        if e["kind"] == "edit_survival" and e["session_id"] in sessions
    ]
    assert sorted(windows) == sorted([30.0, 120.0, 300.0] * accepted)


def test_a_stock_client_names_no_session_and_reports_nothing(
    gateway_url: str, ide_key: str, read_topic: ReadTopic
) -> None:
    report = agent_simulation(gateway_url, ide_key, ClientConfig(mode="stock"), users=3)

    assert report.errors == {}
    assert report.client == "stock"
    assert report.feedback_batches_sent == report.continue_events_sent == 0
    assert report.sessions_started == report.sessions_ended == 3
    assert not any(served.verdict_reported for served in report.served)
    served = {s.request_id: s for s in report.served}
    assert len(served) == report.requests_ok == sum(run.turns for run in report.runs)
    # The gateway derived each run's session (its key, user and opening message) and said so.
    assert all(s.session_id.startswith("auto-") for s in served.values())
    completions = read_topic(
        COMPLETIONS_TOPIC, until=lambda events: served.keys() <= {e["request_id"] for e in events}
    )
    logged = {e["request_id"]: e for e in completions if e["request_id"] in served}
    assert logged.keys() == served.keys()
    assert all(e["session_id"] == served[r].session_id for r, e in logged.items())
    assert sum(e["malformed_tool_calls"] > 0 for e in logged.values()) == report.malformed_turns


def test_a_continue_client_posts_its_own_events_and_the_gateway_joins_them(
    gateway_url: str, make_key: Callable[..., tuple[ApiKey, str]], read_topic: ReadTopic
) -> None:
    _, key = make_key(rate_limit_per_minute=100_000)
    # Every developer looks at every edit, and rates every final answer.
    client = ClientConfig(
        mode="continue",
        unlooked_edit_share=0.0,
        nocode_share=0.0,
        old_schema_share=0.0,
        thumbs_up_share=1.0,
    )
    report = agent_simulation(gateway_url, key, client, users=3)

    assert report.errors == {}
    assert report.feedback_batches_sent == 0
    assert report.continue_events_sent > 0 and report.continue_events_failed == 0
    assert sum(report.continue_outcomes.values()) == report.continue_events_sent
    # An edit's tool call id names the request that made it: never unjoinable, never twice.
    assert report.continue_outcomes["toolUsage:unjoinable"] == 0
    assert report.continue_events_by_outcome["duplicate"] == 0
    served = {s.request_id: s for s in report.served}
    mapped = report.continue_feedback_mapped

    def of_continue(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The client's events; the gateway also reads conversations (sources `history:*`)."""
        return [
            e
            for e in events
            if e["request_id"] in served and not (e.get("source") or "").startswith("history:")
        ]

    feedback = read_topic(FEEDBACK_TOPIC, until=lambda events: len(of_continue(events)) >= mapped)
    mine = of_continue(feedback)
    assert len(mine) == mapped
    verdicts = {e["request_id"] for e in mine if e["kind"] in ("edit_accepted", "edit_rejected")}
    told = {r for r, s in served.items() if s.verdict_reported}
    assert told <= verdicts
    # The gateway also reads a verdict into a failed call to a tool that sounds like an edit.
    assert verdicts - told <= {r for r, s in served.items() if s.malformed_calls}
    assert all(e["session_id"] == served[e["request_id"]].session_id for e in mine)


def test_gateway_errors_are_counted_and_the_run_still_finishes(gateway_url: str) -> None:
    report = simulate(
        gateway_url,
        "rtrl-not-a-key",
        users=2,
        sessions_per_user=1,
        tasks_per_session=2,
        time_scale=0,
    )
    assert report.requests_sent == report.requests_failed == 4
    assert report.errors == {"chat:http_401": 4}
    assert report.served == [] and report.feedback_batches_sent == 0
    assert report.sessions_started == 2 and report.sessions_ended == 0


def test_an_unreachable_gateway_is_reported_and_a_timed_run_stops_by_itself() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    report = simulate(gone, "key", users=2, duration_s=1.0, rate=20, time_scale=0.001)
    assert isinstance(report, SimulationReport)
    assert report.requests_sent == report.requests_failed > 0
    assert set(report.errors) == {"chat:connection"}
    assert report.sessions_started >= 2


def test_session_starts_are_paced_by_the_rate() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    report = simulate(gone, "key", users=3, sessions_per_user=2, rate=4, time_scale=0)
    assert report.sessions_started == 6
    assert report.wall_s >= 5 / 4


@pytest.mark.parametrize(
    "knobs", [{"users": 0}, {"rate": 0}, {"time_scale": -1}, {"split": "test"}]
)
def test_a_workload_with_impossible_knobs_is_refused(knobs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Workload(**knobs)


def test_sessions_still_open_at_the_time_limit_are_cut() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    # At real time scale developers think 5-60 s between tasks, far past the limit.
    report = simulate(gone, "key", users=2, tasks_per_session=2, time_scale=1, max_wall_s=1)
    assert report.sessions_started == report.sessions_cut == 2
    assert report.requests_sent == 2


@pytest.mark.parametrize("client", ["claude-code", "opencode"])
def test_a_stock_agents_verdicts_reach_the_gateway_only_in_its_own_words(
    gateway_url: str, ide_key: str, read_topic: ReadTopic, client: str
) -> None:
    report = agent_simulation(gateway_url, ide_key, ClientConfig(mode=client), users=4)  # type: ignore[arg-type]

    assert report.errors == {}
    assert report.feedback_batches_sent == report.continue_events_sent == 0
    served = {s.request_id: s for s in report.served}
    edits = {r: s.edit_outcome for r, s in served.items() if s.edit_outcome is not None}
    answers = {r for r, s in served.items() if s.followup_dissatisfied is not None}
    assert edits and answers, "no edit call, or no final answer, in eight runs"
    feedback = read_topic(
        FEEDBACK_TOPIC,
        until=lambda events: (edits.keys() | answers) <= {e["request_id"] for e in events},
    )
    read: dict[str, set[str]] = defaultdict(set)
    for event in feedback:
        if event["request_id"] in served:
            assert event["source"].startswith(f"history:{client}:") or event["source"] in (
                "history:any:next_message",
                "history:any:edit_error",
                "history:any:reread",
            ), event
            read[event["request_id"]].add(event["kind"])
    # What the developer and the file decided, read back from the next request: an applied
    # edit accepted, a refused or unapplicable one rejected (opencode passes the tool's own
    # error through: the fallback for edit tools that report an error reads it).
    for request_id, outcome in edits.items():
        if outcome == "applied":
            assert "edit_accepted" in read[request_id], (request_id, read[request_id])
        else:
            assert "edit_rejected" in read[request_id], (request_id, outcome, read[request_id])
            assert "edit_accepted" not in read[request_id]
    # The developer's next message in the same conversation follows up every final answer.
    unread = {request_id: read[request_id] for request_id in answers}
    assert all("followup_message" in kinds for kinds in unread.values()), unread
