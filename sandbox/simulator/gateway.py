"""The simulated IDE plugin's connection to the gateway: completions and what it reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI

from sandbox.simulator.clients import ClientMode
from sandbox.simulator.population import Developer
from sandbox.simulator.reactions import Feedback
from sandbox.simulator.renderings import RENDERINGS
from sandbox.simulator.report import SimulationReport

RETRYABLE_STATUSES = (429, 503)
MAX_ATTEMPTS = 5
MAX_RETRY_AFTER_S = 30.0
ROUTED_MODEL = "rtrl"
"""The gateway ignores the body's model and picks the checkpoint; the IDE names this one."""
CONTINUE_DESTINATION = "/v1/adapters/continue"


@dataclass(frozen=True)
class Answer:
    """The completion the gateway served for one request."""

    text: str
    checkpoint: str
    latency_s: float
    request_id: str
    """The gateway's id of the request: the client's X-Request-Id, or the one it generated."""
    session_id: str
    """The client's X-Session-Id, or the session the gateway derived."""
    tool_calls: tuple[dict[str, Any], ...] = ()
    """The calls the model made, in the OpenAI shape (id, type, function name/arguments)."""


class GatewayClient:
    """Sends chat completions and feedback like an IDE plugin, and keeps the books.

    Errors are counted in the report and never raised; 429 and 503 are retried after their
    Retry-After, except Continue's events (Continue never retries). Timeouts are not retried:
    the gateway may have served the request already, and a request id is never reused. Only
    the ideal client names its session and requests; the others send the static `X-User-Id`.
    """

    def __init__(
        self,
        gateway_url: str,
        api_key: str,
        report: SimulationReport,
        *,
        concurrency: int,
        timeout_s: float,
        max_tokens: int,
        client: ClientMode = "ideal",
    ) -> None:
        base_url = gateway_url.rstrip("/")
        self.report = report
        self.client = client
        self.max_tokens = max_tokens
        self.completions = AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s
        )
        self.http = httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s
        )
        self.in_flight = asyncio.Semaphore(concurrency)

    async def aclose(self) -> None:
        await self.completions.close()
        await self.http.aclose()

    async def ask(
        self,
        developer: Developer,
        session_id: str,
        request_id: str,
        request: str | list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> Answer | None:
        """The answer to one edit request (its text, or an agent run's messages so far with
        the declared tools), or None (counted) when none came back."""
        body: dict[str, Any] = {
            "model": ROUTED_MODEL,
            "messages": [{"role": "user", "content": request}]
            if isinstance(request, str)
            else request,
            "max_tokens": self.max_tokens,
        }
        if tools:
            body["tools"] = tools
        headers = self._chat_headers(developer, session_id, request_id)
        self.report.requests_sent += 1
        attempt = 0
        while True:
            attempt += 1
            try:
                async with self.in_flight:
                    started = time.perf_counter()
                    raw = await self.completions.chat.completions.with_raw_response.create(
                        **body, extra_headers=headers
                    )
                    latency_s = time.perf_counter() - started
                completion = raw.parse()
            except openai.APIStatusError as exc:
                if exc.status_code in RETRYABLE_STATUSES and attempt < MAX_ATTEMPTS:
                    await self._wait_to_retry(exc.response.headers)
                    continue
                return self._chat_failed(f"http_{exc.status_code}")
            except openai.APITimeoutError:
                return self._chat_failed("timeout")
            except openai.APIConnectionError:
                return self._chat_failed("connection")
            except Exception as exc:  # a malformed answer must not stop the run
                return self._chat_failed(type(exc).__name__)
            message = completion.choices[0].message if completion.choices else None
            checkpoint = raw.headers.get("x-rtrl-checkpoint") or completion.model
            calls = tuple(
                call.model_dump(include={"id", "type", "function"})
                for call in (message.tool_calls or [] if message else [])
            )
            return Answer(
                (message.content if message else None) or "",
                checkpoint,
                latency_s,
                request_id=raw.headers.get("x-request-id") or completion.id or request_id,
                session_id=raw.headers.get("x-rtrl-session-id") or session_id,
                tool_calls=calls,
            )

    def _chat_headers(
        self, developer: Developer, session_id: str, request_id: str
    ) -> dict[str, str]:
        if self.client in RENDERINGS:
            header = RENDERINGS[self.client].session_header
            return {"X-User-Id": developer.user_id} | ({header: session_id} if header else {})
        if self.client != "ideal":
            return {"X-User-Id": developer.user_id}
        headers = {
            "X-Session-Id": session_id,
            "X-User-Id": developer.user_id,
            "X-Request-Id": request_id,
            "X-Rtrl-Edit-Request": "1",
        }
        if developer.privacy:
            headers["X-Rtrl-Privacy"] = "1"
        return headers

    async def send_feedback(self, developer: Developer, events: Sequence[Feedback]) -> bool:
        """Post one batch of IDE events; whether the gateway accepted it (202)."""
        body = {"events": [event.model_dump(mode="json") for event in events]}
        headers = {"X-Rtrl-Privacy": "1"} if developer.privacy else {}
        self.report.feedback_batches_sent += 1
        self.report.feedback_events_sent += len(events)
        attempt = 0
        while True:
            attempt += 1
            try:
                async with self.in_flight:
                    response = await self.http.post("/v1/feedback", json=body, headers=headers)
            except httpx.TimeoutException:
                return self._feedback_failed("timeout")
            except httpx.HTTPError:
                return self._feedback_failed("connection")
            if response.status_code == 202:
                self.report.feedback_batches_accepted += 1
                self.report.feedback_events_accepted += len(events)
                return True
            if response.status_code in RETRYABLE_STATUSES and attempt < MAX_ATTEMPTS:
                await self._wait_to_retry(response.headers)
                continue
            return self._feedback_failed(f"http_{response.status_code}")

    async def post_continue_event(self, developer: Developer, event: dict[str, Any]) -> None:
        """Post one Continue event, once, as Continue does: a failure is counted and lost."""
        self.report.continue_events_sent += 1
        try:
            async with self.in_flight:
                response = await self.http.post(
                    CONTINUE_DESTINATION, json=event, headers={"X-User-Id": developer.user_id}
                )
        except httpx.TimeoutException:
            return self._continue_failed("timeout")
        except httpx.HTTPError:
            return self._continue_failed("connection")
        if response.status_code != 202:
            return self._continue_failed(f"http_{response.status_code}")
        try:
            answer = response.json()
            outcome, kinds = str(answer["outcome"]), list(answer.get("feedback") or [])
        except (ValueError, KeyError, TypeError):
            return self._continue_failed("unreadable_answer")
        self.report.continue_outcomes[f"{event['name']}:{outcome}"] += 1
        if outcome == "mapped":
            self.report.continue_feedback_mapped += len(kinds)

    async def _wait_to_retry(self, headers: Mapping[str, str]) -> None:
        self.report.retries += 1
        try:
            wait_s = float(headers.get("retry-after", "1"))
        except ValueError:
            wait_s = 1.0
        await asyncio.sleep(min(max(wait_s, 0.0), MAX_RETRY_AFTER_S))

    def _chat_failed(self, cause: str) -> Answer | None:
        self.report.requests_failed += 1
        self.report.errors[f"chat:{cause}"] += 1
        return None

    def _continue_failed(self, cause: str) -> None:
        self.report.continue_events_failed += 1
        self.report.errors[f"continue:{cause}"] += 1

    def _feedback_failed(self, cause: str) -> bool:
        self.report.feedback_batches_failed += 1
        self.report.errors[f"feedback:{cause}"] += 1
        return False
