"""One API key cannot hold every vLLM slot: past its share of requests in flight on a gateway,
its next request is a 429 at once, and other keys are served meanwhile."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from app.config import Settings
from app.http.state import app_state
from tests.gateway.conftest import GatewayServer


def body(stream: bool = False) -> dict[str, Any]:
    # Generated to the length cap past the end of sentence: each answer takes a while.
    return {
        "model": "rtrl",
        "messages": [{"role": "user", "content": "Write f(x) that returns x plus 3."}],
        "stream": stream,
        "max_tokens": 900,
        "ignore_eos": True,
    }


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "X-Session-Id": f"s-{uuid.uuid4().hex[:8]}"}


def test_a_key_past_its_requests_in_flight_gets_a_429_and_others_are_served(
    gateway_settings: Settings,
    start_gateway: Callable[[Settings], GatewayServer],
    make_key: Callable[..., str],
) -> None:
    gateway = start_gateway(gateway_settings.model_copy(update={"max_in_flight_per_key": 2}))
    in_flight = app_state(gateway.app).in_flight
    greedy, other = make_key(), make_key()
    url = f"{gateway.url}/v1/chat/completions"

    def ask(key: str) -> httpx.Response:
        return httpx.post(url, json=body(), headers=headers(key), timeout=120)

    def burst() -> tuple[list[httpx.Response], httpx.Response]:
        """Eight at once from one key, one from another key among them, from one client
        behind a barrier (threads that each opened a client of their own were seen to arrive
        one at a time on a loaded machine, each answered before the next came)."""
        start = threading.Barrier(9)
        limits = httpx.Limits(max_connections=9, max_keepalive_connections=9)
        with httpx.Client(timeout=120, limits=limits) as client:

            def send(key: str) -> httpx.Response:
                start.wait(timeout=60)
                return client.post(url, json=body(), headers=headers(key))

            with ThreadPoolExecutor(9) as pool:
                futures = [pool.submit(send, greedy) for _ in range(8)]
                others = pool.submit(send, other)
                return [future.result() for future in futures], others.result()

    # On a starved machine a connect to the local vLLM can pass its 2 s limit: such an answer
    # is a clear 503 `upstream_unavailable` that gives its place back at once, so the burst's
    # later requests are admitted and it shows nothing about fairness (seen in CI beside
    # stalls of the whole machine). Such a burst is asked again.
    for _ in range(3):
        answers, others = burst()
        starved = [answer for answer in [*answers, others] if _starved(answer)]
        if not starved:
            break
    assert not starved, [(answer.status_code, answer.text[:300]) for answer in starved]
    statuses = sorted(answer.status_code for answer in answers)
    assert set(statuses) == {200, 429}, [
        (answer.status_code, answer.text[:300]) for answer in answers
    ]
    assert statuses.count(200) >= 2
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_requests_in_flight"
    assert others.status_code == 200, others.text
    assert in_flight.in_flight() == 0  # every answer gave its place back

    # Streams the client drops give their places back too.
    with httpx.Client(timeout=120) as client:
        for _ in range(2):
            with client.stream("POST", url, json=body(stream=True), headers=headers(greedy)) as s:
                assert s.status_code == 200
                next(s.iter_lines())
    deadline = time.monotonic() + 30
    while in_flight.in_flight() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight.in_flight() == 0
    assert ask(greedy).status_code == 200


def _starved(answer: httpx.Response) -> bool:
    return answer.status_code == 503 and answer.json()["error"]["code"] in {
        "upstream_unavailable",
        "request_id_unavailable",
    }
