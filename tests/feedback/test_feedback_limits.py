"""`POST /v1/feedback` limits what one key may say about one request, and stamps every event
with the time the gateway received it."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from tests.feedback.test_feedback_batches import auth, event


def survival(session: str, request_id: str, elapsed_s: float) -> dict[str, Any]:
    return event("edit_survival", session, request_id, elapsed_s=elapsed_s, surviving_share=1.0)


def limited(kind: str) -> float:
    return REGISTRY.get_sample_value("rtrl_feedback_limited_total", {"kind": kind}) or 0.0


def post(client: TestClient, key: str, *events: dict[str, Any]) -> Any:
    return client.post("/v1/feedback", json={"events": list(events)}, headers=auth(key))


def test_the_ninth_survival_report_on_a_request_is_refused_with_a_409_naming_it(
    client: TestClient, ide_key: str, serve: Callable[..., tuple[str, str]]
) -> None:
    session, request_id = serve()
    reports = [survival(session, request_id, 30 * (n + 1)) for n in range(9)]
    before = limited("edit_survival")

    assert post(client, ide_key, *reports[:5]).json() == {"accepted": 5, "duplicates": 0}
    assert post(client, ide_key, *reports[5:8]).json() == {"accepted": 3, "duplicates": 0}
    thanks = event("followup_message", session, request_id, message="thanks, works")
    refused = post(client, ide_key, thanks, reports[8])

    assert refused.status_code == 409
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "conflict_error",
        "feedback_limit_reached",
        "events[1]",
    )
    assert "at most 8 edit_survival" in error["message"] and request_id in error["message"]
    assert limited("edit_survival") == before + 1
    # Nothing of the refused batch was taken: without the named event, the rest goes through.
    assert post(client, ide_key, thanks).json() == {"accepted": 1, "duplicates": 0}
    # A report already taken, sent again, is a duplicate, not one more.
    assert post(client, ide_key, reports[0]).json() == {"accepted": 0, "duplicates": 1}


def test_one_verdict_of_each_kind_and_one_session_end_a_request(
    client: TestClient, ide_key: str, serve: Callable[..., tuple[str, str]]
) -> None:
    session, first = serve()
    _, second = serve(**{"X-Session-Id": session})
    accepted = post(
        client,
        ide_key,
        event("edit_accepted", session, first),
        event("edit_rejected", session, first),  # some hunks kept, others not
        event("session_end", session, first),
    )
    assert accepted.status_code == 202, accepted.text

    for kind in ("edit_accepted", "edit_rejected", "session_end"):
        again = post(client, ide_key, event(kind, session, first))
        assert (again.status_code, again.json()["error"]["param"]) == (409, "events[0]")
        assert f"at most 1 {kind}" in again.json()["error"]["message"]
    # The other request of the session has limits of its own.
    later = post(
        client,
        ide_key,
        event("edit_accepted", session, second),
        event("session_end", session, second),
    )
    assert later.status_code == 202, later.text


def test_each_key_has_its_own_limits(
    client: TestClient,
    ide_key: str,
    make_key: Callable[..., str],
    serve: Callable[..., tuple[str, str]],
) -> None:
    other_key = make_key()
    session, request_id = serve()
    other_session, other_request = serve(other_key)
    assert post(client, ide_key, event("edit_accepted", session, request_id)).status_code == 202
    taken = post(client, other_key, event("edit_accepted", other_session, other_request))
    assert taken.status_code == 202


def test_every_event_is_stamped_with_the_time_the_gateway_received_it(
    client: TestClient,
    ide_key: str,
    serve: Callable[..., tuple[str, str]],
    feedback_topic: Any,
) -> None:
    session, request_id = serve()
    since = feedback_topic.mark()
    claims_2100 = event(
        "edit_accepted",
        session,
        request_id,
        occurred_at="2100-01-01T00:00:00Z",
        received_at="2100-01-01T00:00:00Z",
    )
    sent = datetime.now(UTC)
    assert post(client, ide_key, claims_2100).status_code == 202

    published = feedback_topic.read_until(since, claims_2100["event_id"])
    stamped = next(e for e in published if e["event_id"] == claims_2100["event_id"])
    received_at = datetime.fromisoformat(stamped["received_at"])
    assert sent <= received_at <= sent + timedelta(seconds=30)
    assert stamped["occurred_at"].startswith("2100-01-01")  # kept as sent, read within bounds
