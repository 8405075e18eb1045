"""`POST /v1/feedback`: whole batches in, each event once in Kafka, bad batches not at all."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.http.state import app_state

MAX_BATCH = 5


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def event(kind: str, session: str, request_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "event_id": str(uuid.uuid4()),
        "kind": kind,
        "session_id": session,
        "request_id": request_id,
        **fields,
    }


def every_kind(session: str, request_id: str) -> list[dict[str, Any]]:
    return [
        event("edit_accepted", session, request_id),
        event("edit_survival", session, request_id, elapsed_s=120, surviving_share=0.75),
        event("edit_rejected", session, request_id),
        event("followup_message", session, request_id, message="thanks, works"),
        event("session_end", session, request_id),
    ]


def test_a_batch_is_published_once_even_when_sent_twice(
    client: TestClient, ide_key: str, serve: Callable[..., tuple[str, str]], feedback_topic: Any
) -> None:
    session, request_id = serve()
    batch = every_kind(session, request_id)
    since = feedback_topic.mark()

    first = client.post("/v1/feedback", json={"events": batch}, headers=auth(ide_key))
    again = client.post("/v1/feedback", json={"events": batch}, headers=auth(ide_key))
    sentinel = event("followup_message", session, request_id, message="one more thing")
    client.post("/v1/feedback", json={"events": [sentinel]}, headers=auth(ide_key))

    assert first.status_code == 202 and first.json() == {"accepted": 5, "duplicates": 0}
    assert again.status_code == 202 and again.json() == {"accepted": 0, "duplicates": 5}
    published = feedback_topic.read_until(since, sentinel["event_id"])
    ids = [e["event_id"] for e in published if e["session_id"] == session]
    assert sorted(ids) == sorted([e["event_id"] for e in batch] + [sentinel["event_id"]])
    assert {e["_key"] for e in published if e["session_id"] == session} == {session}
    followup = next(
        e for e in published if e["kind"] == "followup_message" and e["session_id"] == session
    )
    assert followup["message"] == "thanks, works"


def test_a_batch_the_gateway_died_before_spooling_is_taken_when_it_is_retried(
    client: TestClient,
    ide_key: str,
    serve: Callable[..., tuple[str, str]],
    feedback_topic: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The gateway fails between checking the ids and spooling the events (a crash, a full
    # disk): the IDE retries, and the retry must not be answered as a duplicate of nothing.
    session, request_id = serve()
    batch = [event("edit_accepted", session, request_id), event("session_end", session, request_id)]
    since = feedback_topic.mark()

    def dies(*args: Any) -> None:
        raise RuntimeError("the gateway died here")

    monkeypatch.setattr(app_state(client.app).sink, "publish", dies)
    with pytest.raises(RuntimeError, match="died here"):
        client.post("/v1/feedback", json={"events": batch}, headers=auth(ide_key))
    monkeypatch.undo()

    retried = client.post("/v1/feedback", json={"events": batch}, headers=auth(ide_key))
    assert retried.status_code == 202 and retried.json() == {"accepted": 2, "duplicates": 0}
    again = client.post("/v1/feedback", json={"events": batch}, headers=auth(ide_key))
    assert again.json() == {"accepted": 0, "duplicates": 2}
    published = feedback_topic.read_until(since, batch[1]["event_id"])
    ids = [e["event_id"] for e in published if e["session_id"] == session]
    assert sorted(ids) == sorted(e["event_id"] for e in batch)


def test_privacy_mode_follow_ups_are_classified_here_and_lose_their_text(
    client: TestClient,
    make_key: Callable[..., str],
    ide_key: str,
    serve: Callable[..., tuple[str, str]],
    feedback_topic: Any,
) -> None:
    session, request_id = serve()
    private_key = make_key(privacy_mode=True)
    key_session, key_request_id = serve(private_key)
    since = feedback_topic.mark()
    complaint = event("followup_message", session, request_id, message="still broken, same error")
    praise = event("followup_message", key_session, key_request_id, message="thanks, that fixed it")

    by_header = client.post(
        "/v1/feedback",
        json={"events": [complaint]},
        headers=auth(ide_key, **{"X-Rtrl-Privacy": "1"}),
    )
    by_key = client.post("/v1/feedback", json={"events": [praise]}, headers=auth(private_key))

    assert by_header.status_code == by_key.status_code == 202
    published = {e["event_id"]: e for e in feedback_topic.read_until(since, praise["event_id"])}
    assert published[complaint["event_id"]]["message"] is None
    assert published[complaint["event_id"]]["dissatisfied"] is True
    assert published[praise["event_id"]]["message"] is None
    assert published[praise["event_id"]]["dissatisfied"] is False


def test_a_privacy_completion_keeps_its_follow_ups_private_whatever_the_feedback_call_says(
    client: TestClient, ide_key: str, serve: Callable[..., tuple[str, str]], feedback_topic: Any
) -> None:
    session, request_id = serve(**{"X-Rtrl-Privacy": "1"})
    since = feedback_topic.mark()
    complaint = event("followup_message", session, request_id, message="still broken, same error")

    response = client.post("/v1/feedback", json={"events": [complaint]}, headers=auth(ide_key))

    assert response.status_code == 202
    published = {e["event_id"]: e for e in feedback_topic.read_until(since, complaint["event_id"])}
    assert published[complaint["event_id"]]["message"] is None
    assert published[complaint["event_id"]]["dissatisfied"] is True


def test_feedback_from_another_key_is_answered_as_an_unknown_request_id(
    client: TestClient,
    make_key: Callable[..., str],
    ide_key: str,
    serve: Callable[..., tuple[str, str]],
    feedback_topic: Any,
) -> None:
    session, request_id = serve()
    other_key = make_key()
    since = feedback_topic.mark()
    foreign = event("edit_rejected", session, request_id)
    unknown = event("edit_rejected", session, "r-never-served")

    by_other = client.post("/v1/feedback", json={"events": [foreign]}, headers=auth(other_key))
    never_served = client.post("/v1/feedback", json={"events": [unknown]}, headers=auth(other_key))
    wrong_session = client.post(
        "/v1/feedback",
        json={"events": [event("edit_rejected", "s-elsewhere", request_id)]},
        headers=auth(other_key),
    )

    assert by_other.status_code == never_served.status_code == wrong_session.status_code == 404
    refusal = by_other.json()["error"]
    assert refusal["code"] == "unknown_request_id"
    assert refusal == never_served.json()["error"] | {"message": refusal["message"]}
    assert request_id in refusal["message"]
    assert (
        refusal["message"].replace(request_id, "r-never-served")
        == (never_served.json()["error"]["message"])
    )
    sentinel = event("session_end", session, request_id)
    assert client.post(
        "/v1/feedback", json={"events": [sentinel]}, headers=auth(ide_key)
    ).json() == {"accepted": 1, "duplicates": 0}
    published = feedback_topic.read_until(since, sentinel["event_id"])
    assert foreign["event_id"] not in {e["event_id"] for e in published}


def bad_batches(session: str, request_id: str, other_session: str) -> list[Any]:
    """(body, status, param or code) — each batch leads with a valid event."""

    def after_valid(*events: dict[str, Any]) -> dict[str, Any]:
        return {"events": [event("edit_accepted", session, request_id), *events]}

    return [
        (after_valid(event("edit_pasted", session, request_id)), 422, "events[1].kind"),
        (
            after_valid(
                event("edit_survival", session, request_id, elapsed_s=30, surviving_share=1.5)
            ),
            422,
            "events[1].surviving_share",
        ),
        (
            after_valid(
                event("edit_survival", session, request_id, elapsed_s=-5, surviving_share=0.5)
            ),
            422,
            "events[1].elapsed_s",
        ),
        (after_valid(event("followup_message", session, request_id)), 422, "events[1]"),
        (after_valid(event("edit_accepted", session, request_id, extra=1)), 422, "events[1].extra"),
        (
            after_valid(event("edit_accepted", session, "r-never-served")),
            404,
            "events[1].request_id",
        ),
        (
            after_valid(event("edit_accepted", other_session, request_id)),
            422,
            "events[1].session_id",
        ),
        (
            after_valid(event("edit_accepted", "bad session", request_id)),
            422,
            "events[1].session_id",
        ),
        ({"events": []}, 422, "events"),
        ({"evnts": []}, 422, "events"),
        (
            after_valid(*[event("edit_accepted", session, request_id)] * MAX_BATCH),
            413,
            "events",
        ),
        (
            after_valid(event("followup_message", session, request_id, message="x" * 70_000)),
            413,
            None,
        ),
    ]


def test_bad_batches_are_refused_whole_and_nothing_is_published(
    client: TestClient, ide_key: str, serve: Callable[..., tuple[str, str]], feedback_topic: Any
) -> None:
    session, request_id = serve()
    other_session, _ = serve()
    since = feedback_topic.mark()
    refused_ids: set[str] = set()

    for body, status, param in bad_batches(session, request_id, other_session):
        response = client.post("/v1/feedback", json=body, headers=auth(ide_key))
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param, error
        refused_ids |= {e["event_id"] for e in body.get("events", []) if isinstance(e, dict)}

    for content, status in ((b"{oops", 400), (b"[]", 422)):
        assert (
            client.post("/v1/feedback", content=content, headers=auth(ide_key)).status_code
            == status
        )
    assert client.post("/v1/feedback", json={"events": []}).status_code == 401

    sentinel = event("session_end", session, request_id)
    accepted = client.post("/v1/feedback", json={"events": [sentinel]}, headers=auth(ide_key))
    assert accepted.json() == {"accepted": 1, "duplicates": 0}
    published = feedback_topic.read_until(since, sentinel["event_id"])
    assert refused_ids.isdisjoint(e["event_id"] for e in published)
