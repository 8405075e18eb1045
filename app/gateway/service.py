"""Serving one chat completion: route it, call vLLM, answer the client, log the sample."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import anyio
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.abtest.assignment import Assignment
from app.events import (
    COMPLETIONS_TOPIC,
    FEEDBACK_TOPIC,
    CompletionEvent,
    CompletionStatus,
    SideRequest,
    Surface,
    encode,
)
from app.gateway.joins import (
    queue_answer,
    queue_session_calls,
    request_of_tool_call,
    with_client_ids,
)
from app.gateway.metrics import (
    COMPLETION_LATENCY,
    COMPLETIONS,
    FALLBACKS,
    HISTORY_EVIDENCE,
    PRIVATE_UNREMEMBERED,
    TTFT,
    UPSTREAM_BUSY,
    UPSTREAM_UNAVAILABLE,
)
from app.gateway.routing_cache import RoutingCache
from app.gateway.sampling import sampling_constraints, with_neutral_sampling
from app.gateway.schemas import ChatRequest
from app.gateway.sink import EventSink
from app.gateway.spool import Envelope
from app.gateway.toolcalls import (
    ToolSchemas,
    asks_clarifying_question,
    proposes_edit,
)
from app.gateway.trajectories import (
    TURN_TTL_S,
    Placement,
    Trajectories,
    Turn,
    history_digests,
    queue_turn,
    run_owner,
    token_digest,
)
from app.gateway.upstream import (
    BROKEN,
    Upstream,
    UpstreamBusy,
    UpstreamReply,
    UpstreamStream,
    UpstreamTooLarge,
    UpstreamUnavailable,
)
from app.http.errors import ApiError
from app.models import Sample
from app.observability import UpstreamWait
from app.serving.vllm import vllm_device
from app.signals.history import (
    HistoryFeedback,
    distill,
    feedback_of,
    survival,
    survival_feedback,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

CHAT_PATH = "/v1/chat/completions"
REQUEST_ID_TTL_S = 6 * 3600
"""How long Redis remembers a served request id: the window in which feedback for it is
accepted. Uniqueness has no window: past it, Postgres' samples still refuse a reused id."""
# vLLM extension fields the gateway always asks for and hides unless the client asked too.
_TOKEN_ID_FIELDS = ("prompt_token_ids", "prompt_text")
_UPSTREAM_FAILURES = (UpstreamUnavailable, UpstreamBusy, *BROKEN)
"""What calling vLLM raises when it could not be asked or failed on the way."""


class Unserved(ApiError):
    """Nothing was served for the request, so its id may be used again."""


def request_key(request_id: str) -> str:
    """The Redis key remembering that the gateway served `request_id` (value: a `Served`)."""
    return f"rtrl:req:{request_id}"


@dataclass(frozen=True, slots=True)
class Served:
    """What feedback on a request must agree with, fixed when the request was served."""

    session_id: str
    api_key_id: str | None
    """The key that was served; None in a value written before owners were recorded."""
    privacy: bool

    def encode(self) -> bytes:
        return orjson.dumps(
            {"session_id": self.session_id, "api_key_id": self.api_key_id, "privacy": self.privacy}
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Served:
        """The stored value; an older one (a bare session id) has no owner and counts as private."""
        try:
            fields = orjson.loads(raw)
            return cls(
                str(fields["session_id"]), str(fields["api_key_id"]), bool(fields["privacy"])
            )
        except (orjson.JSONDecodeError, KeyError, TypeError):
            session_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            return cls(session_id, None, True)


@dataclass(slots=True)
class RunLink:
    """The lookup of the request's place in its agent run, made beside the model call."""

    lookup: asyncio.Future[Placement] | None = None
    digests: list[str] | None = None
    """The request's `history_digests`: made once, for the lookup and the turn's memory."""

    def placement(self, request_id: str) -> Placement:
        """Where the request sits; a run of its own when the lookup failed or is not done,
        marked `unknown` (whether its history is private is not known then)."""
        lookup = self.lookup
        if lookup is None:
            return Placement(request_id, 0, None)
        if lookup.done():
            if not lookup.cancelled() and lookup.exception() is None:
                return lookup.result()
        else:
            log.warning("request %s: run lookup unfinished when logged", request_id)
        return Placement(request_id, 0, None, unknown=True)

    async def settled(self) -> None:
        """Wait for the lookup: one Redis round trip, bounded by the client's timeouts."""
        if self.lookup is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.lookup)


@dataclass(frozen=True, slots=True)
class ChatCall:
    """Everything known about a chat request before vLLM is called."""

    request: ChatRequest
    body: dict[str, Any]
    session_id: str
    request_id: str
    user_hash: str
    api_key_id: uuid.UUID
    privacy: bool
    edit_requested: bool
    received_at: datetime
    started: float
    """`time.perf_counter()` when the request arrived."""
    client_request_id: bool = False
    """The client chose the request id (X-Request-Id); a generated one cannot collide."""
    parent_request_id: str | None = None
    """X-Rtrl-Parent-Request-Id: the client names the turn this one continues."""
    edit_requested_explicitly: bool = False
    """X-Rtrl-Edit-Request was sent: it wins over what the run was asked."""
    max_tokens_asked: int | None = None
    """The completion tokens the client asked for when more than the cap (served at the cap)."""
    surface: Surface = "chat"
    """The API the client spoke (`CompletionEvent.surface`); all are served as chat."""
    side_request: SideRequest | None = None
    """What the client asks besides its turns (a title, a commit message, ...), if it does."""
    link: RunLink = field(default_factory=lambda: RunLink())
    upstream_wait: UpstreamWait = field(default_factory=lambda: UpstreamWait())
    """How long vLLM took to answer: the rest of the request's time is the gateway's own."""

    @property
    def run_owner(self) -> str:
        """Whose runs this request may continue (`run_owner`)."""
        return run_owner(self.api_key_id, self.user_hash)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.request.logprobs)

    @property
    def wants_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))


@dataclass
class CompletionRecord:
    """What came back, accumulated from one response or from a stream's chunks."""

    text_parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    first_token_timed: bool = True
    """Whether `first_token_at` was measured: streamed, or from vLLM's per-request timing of a
    whole answer (without it, a whole answer's first token is only known to be before its
    end)."""
    finished_at: float | None = None
    cancelled: bool = False
    """The client went away before the end of the stream."""

    @property
    def status(self) -> CompletionStatus:
        """How the completion ended (see `CompletionEvent.status`)."""
        if self.error is not None:
            return "error"
        if self.cancelled:
            return "cancelled"
        if self.finish_reason is None:
            return "truncated"
        return "ok"

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add_choice(self, choice: dict[str, Any], *, message_key: str, now: float) -> None:
        """Fold one choice (a whole message, or one stream delta) into the record."""
        message = choice.get(message_key) or {}
        content = message.get("content")
        token_ids = choice.get("token_ids") or []
        if (content or message.get("tool_calls") or token_ids) and self.first_token_at is None:
            self.first_token_at = now
        if content:
            self.text_parts.append(content)
        for position, call in enumerate(message.get("tool_calls") or []):
            self._add_tool_call(call.get("index", position), call)
        self.completion_token_ids.extend(token_ids)
        entries = (choice.get("logprobs") or {}).get("content") or []
        self.logprobs.extend(float(entry["logprob"]) for entry in entries)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _add_tool_call(self, index: int, delta: dict[str, Any]) -> None:
        call = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        arguments = function.get("arguments")
        if isinstance(arguments, dict):
            arguments = orjson.dumps(arguments).decode()
        call["function"]["arguments"] += arguments or ""


class Gateway:
    """The gateway's long-lived parts, and the chat completion flow over them."""

    def __init__(
        self,
        *,
        upstream: Upstream,
        routing: RoutingCache,
        sink: EventSink,
        redis: Redis,
        session_maker: async_sessionmaker[AsyncSession] | None = None,
    ) -> None:
        self.upstream = upstream
        self.routing = routing
        self.sink = sink
        self.redis = redis
        self.session_maker = session_maker
        self.trajectories = Trajectories(redis)
        self._background: set[asyncio.Future[None]] = set()

    async def assign(self, user_hash: str) -> Assignment:
        """The checkpoint that serves this user now, falling back to production if unserved."""
        table = self.routing.table
        if self.upstream.context_tokens is None:
            # The model's context, from the same listing (cached): `upstream_body` holds each
            # request's token budget within it.
            await self.upstream.served_models()
        if table.experiment is None:
            return table.assign(user_hash)
        assignment = table.assign(user_hash, await self.upstream.served_models())
        if assignment.unserved is not None:
            FALLBACKS.labels(assignment.unserved).inc()
        return assignment

    async def reserve_request_id(
        self, request_id: str, served: Served, *, chosen_by_client: bool = True
    ) -> None:
        """Remember the request id for feedback; 409 when it was already used, at any age.

        Without Redis the request is refused (503): a sample whose id was not recorded could
        never receive feedback, and would be trained on as if nothing had happened to it.
        """
        try:
            fresh = await self.redis.set(
                request_key(request_id), served.encode(), nx=True, ex=REQUEST_ID_TTL_S
            )
        except RedisError:
            log.warning("request id %s not recorded: Redis unavailable; refused", request_id)
            raise Unserved.service_unavailable(
                "The request cannot be recorded right now; retry shortly.",
                code="request_id_unavailable",
                retry_after_s=1,
            ) from None
        if not fresh:
            raise _duplicate(request_id)
        if chosen_by_client and await self._stored_long_ago(request_id):
            # Redis forgot it; the id must not now point feedback at this new session.
            await self.release_request_id(request_id)
            raise _duplicate(request_id)

    async def _stored_long_ago(self, request_id: str) -> bool:
        """Whether a sample with this id is stored (Redis remembers only the recent ones)."""
        if self.session_maker is None:
            return False
        try:
            async with self.session_maker() as session:
                found = await session.scalar(
                    select(Sample.id).where(Sample.request_id == request_id).limit(1)
                )
        except OperationalError:
            log.warning("request id %s not checked in Postgres: unavailable", request_id)
            return False
        return found is not None

    async def _alongside(self, call: ChatCall, model_call: Awaitable[T]) -> T:
        """The model call's result once the request id is known to be fresh.

        The id is reserved in Redis while vLLM works, keeping a round trip off the critical
        path; a reused id cancels the call, and a call that served nothing frees the id.
        """
        # The model call first: tasks start in order, and the request to vLLM is the one on
        # the critical path.
        work = asyncio.ensure_future(model_call)
        if call.privacy:
            # Before the answer, whatever becomes of it: a turn the user stops or that fails
            # is re-sent in the next request's history all the same.
            await self._remember_private(call)
        call.link.lookup = asyncio.ensure_future(self._place(call))
        reservation = asyncio.ensure_future(
            self.reserve_request_id(
                call.request_id,
                Served(call.session_id, str(call.api_key_id), call.privacy),
                chosen_by_client=call.client_request_id,
            )
        )
        try:
            await reservation
        except BaseException:
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise
        try:
            result = await work
        except Unserved:
            await self.release_request_id(call.request_id)
            # Refused (a prompt past the context, an upstream that failed), the request still
            # carries the client's account of the turn it continues.
            self._in_background(self._read_history_of_refused(call))
            raise
        placement = await self._settled_placement(call)
        if not call.privacy and logged_private(call, placement):
            await self._mark_private(call)
        self._in_background(self._read_history(call, placement))
        return result

    async def _settled_placement(self, call: ChatCall) -> Placement:
        """The request's place in its run, once its lookup is done."""
        # Almost always done by now; a turn logged before it would start a run of its own,
        # and the turns after it would continue that one.
        await call.link.settled()
        if call.link.placement(call.request_id).parent is None and _continues_a_run(call):
            # The previous turn's memory is written as its answer leaves, not before: a turn
            # sent at once can look before it lands. Looked up again, a model call later.
            call.link.lookup = asyncio.ensure_future(self._place(call, again=True))
            await call.link.settled()
        return call.link.placement(call.request_id)

    async def _place(self, call: ChatCall, *, again: bool = False) -> Placement:
        """The request's place in its run; its history's digests are kept for its memory."""
        if call.link.digests is None:
            call.link.digests = history_digests(call.request.messages, call.run_owner)
        return await self.trajectories.place(
            call.run_owner,
            call.request_id,
            call.request.messages,
            call.parent_request_id,
            call.link.digests,
            # A first look that misses is asked again (`_alongside`); only the last counts.
            count_miss=again or not _continues_a_run(call),
        )

    async def _read_history(self, call: ChatCall, placement: Placement) -> None:
        """The client's account, in this request, of what became of the turn it continues
        (`app.signals.history`): feedback on that turn, and survival windows on the run's
        earlier edits whose files it shows again, sent once, by the first request that
        continues it, whether this one is served or refused."""
        # A side request re-sends the history with the client's own message after it: it
        # tells nothing of the turn it follows.
        if placement.parent is None or placement.parent_at is None or call.side_request is not None:
            return
        messages, at = call.request.messages, placement.parent_at
        evidence = distill(messages[at], messages[at + 1 :])
        events: list[HistoryFeedback] = [
            *feedback_of(
                evidence,
                placement.parent.request_id,
                call.session_id,
                private=logged_private(call, placement),
                at=call.received_at,
            )
        ]
        survived = survival(messages[: at + 1], messages[at + 1 :], request_of_tool_call)
        try:
            if survived:
                events += survival_feedback(
                    survived,
                    await self._evidence_read_at(call.run_owner, [s.request_id for s in survived]),
                    call.session_id,
                    at=call.received_at,
                )
            if not events:
                return
            # The value is when: an edit's acceptance, read here, starts its survival clock.
            first = await self.redis.set(
                evidence_key(call.run_owner, placement.parent.request_id),
                call.received_at.timestamp(),
                nx=True,
                ex=TURN_TTL_S,
            )
        except RedisError:
            log.warning("evidence on %s not sent: Redis unavailable", placement.parent.request_id)
            return
        if not first:
            return
        for event in events:
            HISTORY_EVIDENCE.labels(event.source or "").inc()
            self.sink.publish_encoded(Envelope(FEEDBACK_TOPIC, event.session_id, encode(event)))

    async def _evidence_read_at(
        self, owner: str, request_ids: Sequence[str]
    ) -> list[datetime | None]:
        """When the evidence on each turn was read (its acceptance, for an applied edit); None
        where it was not, or before this was recorded. The markers are the owner's (key and
        user): a history that names another's request by a forged call id finds none."""
        found = await self.redis.mget([evidence_key(owner, rid) for rid in request_ids])
        times: list[datetime | None] = []
        for raw in found:
            try:
                seconds = float(raw) if raw is not None else 0.0
            except ValueError:
                seconds = 0.0
            times.append(datetime.fromtimestamp(seconds, UTC) if seconds > 1e9 else None)
        return times

    async def _read_history_of_refused(self, call: ChatCall) -> None:
        await self._read_history(call, await self._settled_placement(call))

    async def _remember_private(self, call: ChatCall) -> None:
        try:
            await self.trajectories.remember_private(call.run_owner, call.request.messages)
        except RedisError:
            PRIVATE_UNREMEMBERED.inc()
            log.warning(
                "private request %s not remembered: Redis unavailable; a later request that "
                "re-sends its messages is private only if its run lookup fails too",
                call.request_id,
            )

    async def _mark_private(self, call: ChatCall) -> None:
        """A turn that continues a private run: its feedback is private too."""
        served = Served(call.session_id, str(call.api_key_id), True)
        try:
            await self.redis.set(
                request_key(call.request_id), served.encode(), xx=True, keepttl=True
            )
        except RedisError:
            log.warning(
                "request %s of a private run not marked private: Redis unavailable",
                call.request_id,
            )

    async def release_request_id(self, request_id: str) -> None:
        """Forget a request id nothing was served for, so the client may retry with it."""
        try:
            await self.redis.delete(request_key(request_id))
        except RedisError:
            log.warning("request id %s not released: Redis unavailable", request_id)

    def upstream_body(self, call: ChatCall, checkpoint: str) -> dict[str, Any]:
        """The client's body, aimed at the checkpoint, asking for token ids and logprobs, with
        every sampling parameter it leaves out at vLLM's neutral value (what the event logs),
        and its token budget within the model's context."""
        body = with_neutral_sampling(call.body)
        context = self.upstream.context_tokens
        for param in ("max_tokens", "max_completion_tokens"):
            # vLLM refuses a budget beyond the model's context, and fits one within it to
            # the prompt itself: a client's 32,000 on a small model is served, not refused.
            if context is not None and isinstance(body.get(param), int) and body[param] > context:
                body[param] = context
        if vllm_device() == "cpu":
            # vLLM's CPU backend kills its engine on a seeded request (every user then gets
            # 500s until a restart), so a seed is never forwarded to it.
            body.pop("seed", None)
        body["model"] = checkpoint
        body["logprobs"] = True
        if not call.wants_logprobs:
            body["top_logprobs"] = 0
        body["return_token_ids"] = True
        return body

    async def complete(self, call: ChatCall, assignment: Assignment) -> tuple[bytes, Assignment]:
        """A non-streaming completion: the client's body and who served it.

        The sample is logged (written ahead to the spool) before the client has its answer,
        so a gateway that dies the moment after answering has not lost it.
        """
        reply, assignment = await self._alongside(call, self._post(call, assignment))
        now = time.perf_counter()
        data = orjson.loads(reply.body)
        record = CompletionRecord(finished_at=now)
        choices = data.get("choices") or []
        if choices:
            record.add_choice(choices[0], message_key="message", now=now)
        # vLLM's timing of the answer (--enable-per-request-metrics): its decode interval,
        # first output token to last, ends when the gateway has the answer.
        generation_ms = (data.pop("metrics", None) or {}).get("generation_time_ms")
        if generation_ms is not None and record.first_token_at is not None:
            record.first_token_at = now - min(float(generation_ms) / 1000, now - call.started)
        else:
            record.first_token_timed = False
        record.prompt_token_ids = data.get("prompt_token_ids")
        body = orjson.dumps(self._client_view(call, data))
        self._log_completion(call, assignment, record)
        return body, assignment

    async def _post(
        self, call: ChatCall, assignment: Assignment
    ) -> tuple[UpstreamReply, Assignment]:
        try:
            body = self.upstream_body(call, assignment.checkpoint)
            call.upstream_wait.ask()
            reply = await self.upstream.post(CHAT_PATH, body)
            if reply.status == 404 and self._can_fall_back(assignment):
                assignment = self._fallback(assignment)
                reply = await self.upstream.post(
                    CHAT_PATH, self.upstream_body(call, assignment.checkpoint)
                )
        except _UPSTREAM_FAILURES as exc:
            raise self._upstream_failure(call, assignment, exc) from exc
        call.upstream_wait.answer()
        if reply.status != 200:
            self._refused(call, assignment, reply.status, reply.body)
        return reply, assignment

    async def open_stream(
        self, call: ChatCall, assignment: Assignment, client_gone: Callable[[], Awaitable[bool]]
    ) -> tuple[AsyncIterator[bytes], Assignment]:
        """Start a streaming completion; errors before the first byte answer as JSON.

        `client_gone` says whether the client has disconnected (the request's
        `is_disconnected`): the stream's end is logged as served only if it has not."""
        stack = AsyncExitStack()
        try:
            response, assignment = await self._alongside(call, self._open(call, assignment, stack))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        return self._relay(call, assignment, response, stack, client_gone), assignment

    async def _open(
        self, call: ChatCall, assignment: Assignment, stack: AsyncExitStack
    ) -> tuple[UpstreamStream, Assignment]:
        try:
            body = self.upstream_body(call, assignment.checkpoint)
            call.upstream_wait.ask()
            response = await stack.enter_async_context(self.upstream.stream(CHAT_PATH, body))
            if response.status == 404 and self._can_fall_back(assignment):
                await stack.aclose()
                assignment = self._fallback(assignment)
                response = await stack.enter_async_context(
                    self.upstream.stream(CHAT_PATH, self.upstream_body(call, assignment.checkpoint))
                )
            if response.status != 200:
                self._refused(call, assignment, response.status, await response.read())
        except _UPSTREAM_FAILURES as exc:
            raise self._upstream_failure(call, assignment, exc) from exc
        return response, assignment

    async def _relay(
        self,
        call: ChatCall,
        assignment: Assignment,
        response: UpstreamStream,
        stack: AsyncExitStack,
        client_gone: Callable[[], Awaitable[bool]],
    ) -> AsyncIterator[bytes]:
        record = CompletionRecord()
        try:
            async for lines in response.line_batches():
                call.upstream_wait.answer()
                relayed = []
                for line in lines:
                    if not _is_done(line):
                        relayed.append(self._relayed(call, assignment, record, line))
                    elif await _left(client_gone):
                        # The whole answer reached a gateway too busy to see the client leave
                        # first: it was never delivered, so it is not logged as served.
                        record.cancelled = True
                        return
                    else:
                        # Logged before the client learns the stream is complete.
                        self._log_stream_end(call, assignment, record)
                        relayed.append(b"data: [DONE]\n\n")
                if any(relayed):
                    yield b"".join(relayed)
        except (GeneratorExit, asyncio.CancelledError):
            record.cancelled = True
            raise
        except BROKEN as exc:
            record.error = f"stream broken: {type(exc).__name__}: {exc}"[:2000]
            self.upstream.failed_midway(response.replica, exc)
            error = {"message": "The model server failed mid-stream.", "type": "api_error"}
            yield b"data: " + orjson.dumps({"error": error | {"param": None, "code": None}})
            yield b"\n\n"
        finally:
            if record.finished_at is None:  # ended without [DONE]
                self._log_stream_end(call, assignment, record)
            # The client may have gone: close the upstream even inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await stack.aclose()

    def _relayed(
        self, call: ChatCall, assignment: Assignment, record: CompletionRecord, line: bytes
    ) -> bytes:
        """What the client gets of one upstream SSE line other than [DONE] (folded into
        `record`), if anything."""
        if not line.startswith(b"data:"):
            return b""
        chunk = orjson.loads(line[5:].strip())
        now = time.perf_counter()
        if "error" in chunk:
            record.error = str(chunk["error"].get("message", chunk["error"]))[:2000]
        if chunk.get("prompt_token_ids") is not None:
            record.prompt_token_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                record.add_choice(choice, message_key="delta", now=now)
        return b"data: " + orjson.dumps(self._client_view(call, chunk)) + b"\n\n"

    def _client_view(self, call: ChatCall, data: dict[str, Any]) -> dict[str, Any]:
        """Hide the token ids and logprobs the gateway asked for but the client did not, and
        give the response the ids a client's own events can be joined by."""
        with_client_ids(call.request_id, data)
        if not call.wants_token_ids:
            for name in _TOKEN_ID_FIELDS:
                data.pop(name, None)
        for choice in data.get("choices") or []:
            if not call.wants_token_ids:
                choice.pop("token_ids", None)
            if not call.wants_logprobs:
                choice["logprobs"] = None
        return data

    def _can_fall_back(self, assignment: Assignment) -> bool:
        return assignment.checkpoint != self.routing.table.production

    def _fallback(self, assignment: Assignment) -> Assignment:
        # The arm's checkpoint vanished between two reads of the served models.
        self.upstream.forget_served_models()
        FALLBACKS.labels(assignment.checkpoint).inc()
        return Assignment(
            self.routing.table.production,
            assignment.experiment_id,
            assignment.arm,
            fallback=True,
            unserved=assignment.checkpoint,
        )

    def _upstream_failure(self, call: ChatCall, assignment: Assignment, exc: Exception) -> ApiError:
        """The answer to a call vLLM could not take (503, nothing served, the request id
        freed) or that broke on the way (502, logged as failed)."""
        if isinstance(exc, UpstreamUnavailable):
            UPSTREAM_UNAVAILABLE.inc()
            return Unserved.service_unavailable(
                f"The model is unavailable: {exc}. Retry shortly.",
                code="upstream_unavailable",
                retry_after_s=1,
            )
        if isinstance(exc, UpstreamBusy):
            # Never sent to vLLM: nothing to log, and the request id is freed for the retry.
            UPSTREAM_BUSY.inc()
            return Unserved.service_unavailable(
                f"The model server is busy: {exc} (RTRL_UPSTREAM_POOL_WAIT_S). Retry shortly.",
                code="upstream_busy",
                retry_after_s=1,
            )
        self._log_failure(call, assignment, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, UpstreamTooLarge):
            return ApiError(
                502,
                f"The model server's answer was too large for the gateway ({exc};"
                " RTRL_UPSTREAM_MAX_BODY_BYTES).",
                type="api_error",
                code="upstream_answer_too_large",
            )
        return ApiError(502, "The model server failed mid-request.", type="api_error")

    def _refused(self, call: ChatCall, assignment: Assignment, status: int, content: bytes) -> None:
        message, param = _upstream_error(content)
        if status == 404:
            raise Unserved(
                503,
                f"Checkpoint {assignment.checkpoint} is not being served. Retry shortly.",
                type="service_unavailable",
                code="checkpoint_unavailable",
            )
        if status == 401:
            # vLLM's --api-key refused the gateway's (RTRL_VLLM_API_KEY): not the client's key.
            log.error("vLLM refused the gateway's API key: set RTRL_VLLM_API_KEY to its --api-key")
            raise Unserved(502, "The model server refused the gateway.", type="api_error")
        if status < 500:
            # The request was at fault, not the policy: nothing to learn from, nothing logged.
            raise Unserved(status, message, param=param)
        self._log_failure(call, assignment, f"upstream {status}: {message}")
        raise ApiError(502, f"The model server failed: {message}", type="api_error")

    def _log_stream_end(
        self, call: ChatCall, assignment: Assignment, record: CompletionRecord
    ) -> None:
        """Log a relayed stream once: at its `[DONE]`, or however else it stopped."""
        record.finished_at = time.perf_counter()
        self._log_completion(call, assignment, record)

    def _log_failure(self, call: ChatCall, assignment: Assignment, error: str) -> None:
        record = CompletionRecord(error=error[:2000], finished_at=time.perf_counter())
        self._log_completion(call, assignment, record)

    def _log_completion(
        self, call: ChatCall, assignment: Assignment, record: CompletionRecord
    ) -> None:
        placement = call.link.placement(call.request_id)
        try:
            event, content = completion_parts(call, assignment, record, placement)
        except ValueError:
            log.exception("completion event for %s is invalid; not logged", call.request_id)
            return
        if event.status == "ok":
            # Sent before the answer, not waited for: a next turn that comes at machine speed
            # (an agent's tools ran, Aider sends its lint fixes back at once) and looks before
            # it lands looks again once its own answer is in (`_alongside`).
            self._remember_turn(call, record, event)
        status = event.status
        COMPLETIONS.labels(assignment.checkpoint, status).inc()
        COMPLETION_LATENCY.labels(assignment.checkpoint).observe(event.latency_ms / 1000)
        if status == "ok":
            TTFT.labels(assignment.checkpoint).observe(event.ttft_ms / 1000)
        self.sink.publish_encoded(
            Envelope(COMPLETIONS_TOPIC, call.session_id, encode_completion(event, content))
        )

    def _remember_turn(
        self, call: ChatCall, record: CompletionRecord, event: CompletionEvent
    ) -> asyncio.Future[None]:
        """Let the run's next turn find this one, a client's copy of the answer its request,
        and an edit decision its call: a task (one Redis round trip) that finishes even if the
        client goes.

        The memory is built in the task, not here: digesting the served tokens and the
        history is work the answer need not wait for (an agent's late turn: ~0.2 ms)."""

        async def remember() -> None:
            served = [*(record.prompt_token_ids or ()), *record.completion_token_ids]
            turn = Turn(
                request_id=call.request_id,
                trajectory_id=event.trajectory_id or call.request_id,
                turn_index=event.turn_index,
                edit_requested=event.edit_requested,
                token_count=len(served) if record.prompt_token_ids is not None else -1,
                token_digest=token_digest(served),
                private=event.privacy,
            )
            answer = {
                "role": "assistant",
                "content": record.text,
                "tool_calls": list(record.tool_calls.values()),
            }
            pipe = self.redis.pipeline(transaction=False)
            queue_turn(pipe, call.run_owner, turn, call.request.messages, answer, call.link.digests)
            # The answer's text and edit calls ride along: one round trip for all, the turn's
            # memory first.
            queue_answer(pipe, call.run_owner, call.request_id, record.text)
            queue_session_calls(
                pipe,
                str(call.api_key_id),
                call.session_id,
                call.request_id,
                {index: tool["function"]["name"] for index, tool in record.tool_calls.items()},
                call.received_at.timestamp(),
            )
            try:
                async with pipe:
                    await pipe.execute()
            except RedisError:
                log.warning("turn %s not remembered: Redis unavailable", call.request_id)

        return self._in_background(remember())

    def _in_background(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """A Redis write that finishes even if the client goes; its failure is only logged."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


def evidence_key(owner: str, request_id: str) -> str:
    """Set once the evidence on a served turn was read from a request that continues it, to
    that request's arrival (seconds since the epoch)."""
    return f"rtrl:evidence:{owner}:{request_id}"


def completion_event(
    call: ChatCall,
    assignment: Assignment,
    record: CompletionRecord,
    placement: Placement | None = None,
) -> CompletionEvent:
    """The `rtrl.completions.v1` event of one served request; no content in privacy mode."""
    event, content = completion_parts(call, assignment, record, placement)
    return CompletionEvent.model_validate(event.model_dump() | content) if content else event


_CONTENT_FIELDS = (
    "prompt_messages",
    "prompt_token_ids",
    "completion_token_ids",
    "behaviour_logprobs",
    "completion_text",
)


def completion_parts(
    call: ChatCall,
    assignment: Assignment,
    record: CompletionRecord,
    placement: Placement | None = None,
) -> tuple[CompletionEvent, dict[str, Any]]:
    """The event of one served request without its content, validated, and its content
    (empty in privacy mode): the messages, token ids and logprobs, as parsed from the client
    and vLLM, are written as they came rather than validated and copied once more."""
    placement = placement or Placement(call.request_id, 0, None)
    parent = placement.parent
    edit_requested = (
        parent.edit_requested
        if parent is not None and not call.edit_requested_explicitly
        else call.edit_requested
    )
    request = call.request
    finished = record.finished_at or time.perf_counter()
    latency_ms = (finished - call.started) * 1000
    first = record.first_token_at or finished
    text = record.text
    check = ToolSchemas(call.request.tools).check(list(record.tool_calls.values()), text)
    tokens, logprobs = _served_tokens(call, record)
    private = logged_private(call, placement)
    content: dict[str, Any] = {}
    if not private:
        content = {
            "prompt_messages": call.request.messages,
            "prompt_token_ids": record.prompt_token_ids,
            "completion_token_ids": tokens,
            "behaviour_logprobs": logprobs,
            "completion_text": text,
        }
    event = CompletionEvent(
        session_id=call.session_id,
        request_id=call.request_id,
        occurred_at=call.received_at,
        checkpoint=assignment.checkpoint,
        experiment_id=assignment.experiment_id,
        arm=assignment.arm,
        fallback=assignment.fallback,
        user_hash=call.user_hash,
        api_key_id=call.api_key_id,
        privacy=private,
        edit_requested=edit_requested,
        tools_declared=bool(request.tools),
        surface=call.surface,
        side_request=call.side_request,
        trajectory_id=placement.trajectory_id,
        turn_index=placement.turn_index,
        parent_request_id=parent.request_id if parent is not None else None,
        token_prefix_match=placement.token_prefix_match(record.prompt_token_ids),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None or request.top_k == 0 else request.top_k,
        max_tokens=request.max_completion_tokens or request.max_tokens,
        max_tokens_asked=call.max_tokens_asked,
        sampling_constraints=sampling_constraints(call.body),
        finish_reason=record.finish_reason,
        status=record.status,
        error=record.error,
        ttft_ms=max((first - call.started) * 1000, 0.0),
        ttft_measured=record.first_token_timed,
        latency_ms=max(latency_ms, 0.0),
        completion_tokens=len(record.completion_token_ids),
        tool_calls=check.calls,
        malformed_tool_calls=check.malformed,
        proposed_edit=proposes_edit(text, check),
        completion_chars=len(text),
        clarifying_question=asks_clarifying_question(text, check),
    )
    return event, content


def _served_tokens(
    call: ChatCall, record: CompletionRecord
) -> tuple[list[int], list[float]] | tuple[None, None]:
    """The completion's token ids and logprobs, or neither when it failed or they disagree."""
    if record.error is None and len(record.completion_token_ids) == len(record.logprobs):
        return record.completion_token_ids, record.logprobs
    if record.error is None:
        log.warning(
            "request %s: %d tokens but %d logprobs; not trainable",
            call.request_id,
            len(record.completion_token_ids),
            len(record.logprobs),
        )
    return None, None


def encode_completion(event: CompletionEvent, content: dict[str, Any]) -> bytes:
    """The event as Kafka carries it (`app.events.encode`), its content added as it came."""
    if not content:
        return encode(event)
    fields = event.model_dump(mode="json", exclude=set(_CONTENT_FIELDS))
    return orjson.dumps(fields | content)


def logged_private(call: ChatCall, placement: Placement) -> bool:
    """Whether the request is logged without content and never trained on: privacy mode, a
    private run or a private message in its history, or (failing closed) a history of
    earlier turns whose lookup failed, so that it may be private."""
    return call.privacy or placement.private_run or (placement.unknown and _continues_a_run(call))


def _continues_a_run(call: ChatCall) -> bool:
    """Whether the request names or carries an earlier turn its run lookup could find."""
    return call.parent_request_id is not None or any(
        message.get("role") == "assistant" for message in call.request.messages
    )


def _is_done(line: bytes) -> bool:
    """Whether an upstream SSE line is the stream's end, `data: [DONE]`."""
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


async def _left(client_gone: Callable[[], Awaitable[bool]]) -> bool:
    """Whether the client has gone, asked after one turn of the event loop: a close that
    arrived in the same instant as the answer is then seen, whichever the loop read first."""
    await asyncio.sleep(0)
    return await client_gone()


def _duplicate(request_id: str) -> ApiError:
    return ApiError(
        409,
        f"Request id {request_id!r} was already used; a completion is never replayed. "
        "Send a new X-Request-Id.",
        type="conflict_error",
        code="duplicate_request_id",
        param="X-Request-Id",
    )


def _upstream_error(content: bytes) -> tuple[str, str | None]:
    try:
        error = orjson.loads(content)["error"]
        return str(error.get("message") or "upstream error"), error.get("param")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return content.decode(errors="replace")[:500] or "upstream error", None
