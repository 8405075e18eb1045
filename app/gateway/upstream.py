"""The vLLM replicas behind the gateway: round-robin, failover on connect errors, pooled,
with a bounded wait for a connection when every one is in use.

aiohttp rather than httpx: on this path httpx spends ~1.7 ms of CPU per call against
aiohttp's ~0.3 ms (bench/gateway.py), and the gateway's budget is 2 ms in all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import orjson

from app.gateway.metrics import UPSTREAM_ERRORS
from app.serving.replicas import vllm_headers

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
SERVED_MODELS_TTL_S = 5.0
KEEPALIVE_S = 4.0
"""Below vLLM's (uvicorn's) 5 s keep-alive, so a pooled connection is never stale."""

# Errors that prove the request never reached a replica, so another may take it safely.
NOT_DELIVERED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Errors of a replica that was reached but failed mid-answer.
BROKEN = (aiohttp.ClientError, asyncio.TimeoutError)
_JSON = {"content-type": "application/json"}


class UpstreamUnavailable(Exception):
    """No replica accepted the connection."""


class UpstreamBusy(Exception):
    """Every connection of the pool stayed in use for the whole pool wait; no replica was tried."""


class UpstreamTooLarge(aiohttp.ClientError):
    """A replica's answer was larger than the gateway reads (`max_body_bytes`); it was
    dropped as it came, never held whole."""


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A whole (non-streaming) answer of one replica."""

    replica: str
    status: int
    body: bytes


@dataclass(frozen=True, slots=True)
class UpstreamStream:
    """An open streaming answer of one replica; read its lines before leaving the block."""

    replica: str
    response: aiohttp.ClientResponse

    @property
    def status(self) -> int:
        return self.response.status

    async def read(self) -> bytes:
        return await self.response.read()

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """The body's lines (SSE), without their endings, in batches of all those that
        arrived together: one pass of the relay, and one write to the client, per batch
        rather than per line."""
        partial = b""
        while data := await self.response.content.readany():
            *complete, partial = (partial + data).split(b"\n")
            if complete:
                yield complete
        if partial:
            yield [partial]


class Upstream:
    """One connection pool for every vLLM replica; each request starts at the next one.

    A request holds one of `max_connections` places from before its first connection attempt
    until its answer is released, and waits at most `pool_wait_s` for one. The places, not
    aiohttp's own limit, do the waiting: aiohttp bounds its pool wait only by the `connect`
    timeout, and raises the same `ConnectionTimeoutError` for it as for a replica that does
    not accept the connection, which must fail over; a full pool is no replica's fault.
    """

    def __init__(
        self,
        replicas: list[str],
        *,
        timeout_s: float,
        max_connections: int = 512,
        pool_wait_s: float = 10.0,
        max_body_bytes: int = 32 * 1024 * 1024,
        api_key: str = "",
    ):
        if not replicas:
            raise ValueError("at least one vLLM replica URL is needed")
        self.replicas = list(replicas)
        self.max_connections = max_connections
        self.pool_wait_s = pool_wait_s
        self.max_body_bytes = max_body_bytes
        # Every use of the session holds a place, so aiohttp's limit (the same number) is
        # never the one that makes a request wait.
        self._places = asyncio.Semaphore(max_connections)
        self._next = itertools.count()
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=timeout_s
        )
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
            ),
            timeout=self._timeout,
            # vLLM's --api-key (RTRL_VLLM_API_KEY), on every request to every replica.
            headers=vllm_headers(api_key),
            skip_auto_headers=("User-Agent",),
        )
        self._served: frozenset[str] | None = None
        self._served_until = 0.0
        self.context_tokens: int | None = None
        """The served model's context (`max_model_len` in `/v1/models`; the shortest of any
        replica's), once the models were listed."""
        self._served_lock = asyncio.Lock()

    async def aclose(self) -> None:
        await self._session.close()

    def _order(self) -> list[str]:
        start = next(self._next) % len(self.replicas)
        return self.replicas[start:] + self.replicas[:start]

    @asynccontextmanager
    async def _place(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """One of the pool's places, waited for at most `wait_s` (default `pool_wait_s`);
        UpstreamBusy after."""
        if self._places.locked():
            wait_s = self.pool_wait_s if wait_s is None else wait_s
            try:
                async with asyncio.timeout(wait_s):
                    await self._places.acquire()
            except TimeoutError:
                raise UpstreamBusy(
                    f"all {self.max_connections} connections to vLLM stayed in use for {wait_s:g} s"
                ) from None
        else:
            await self._places.acquire()
        try:
            yield
        finally:
            self._places.release()

    async def post(self, path: str, body: dict[str, object]) -> UpstreamReply:
        """POST JSON to the first replica that accepts the connection; read the answer."""
        content = orjson.dumps(body)
        async with self._place():
            for replica in self._order():
                try:
                    async with self._session.post(
                        f"{replica}{path}", data=content, headers=_JSON
                    ) as response:
                        return UpstreamReply(
                            replica, response.status, await self._read_capped(response)
                        )
                except NOT_DELIVERED as exc:
                    self._failed(replica, exc)
        raise UpstreamUnavailable(self._none_answered())

    async def _read_capped(self, response: aiohttp.ClientResponse) -> bytes:
        """The whole answer, or `UpstreamTooLarge` once it passes `max_body_bytes`."""
        declared = response.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise UpstreamTooLarge(f"{declared} bytes, more than {self.max_body_bytes}")
        body = bytearray()
        async for chunk in response.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > self.max_body_bytes:
                raise UpstreamTooLarge(f"more than {self.max_body_bytes} bytes")
        return bytes(body)

    @asynccontextmanager
    async def stream(self, path: str, body: dict[str, object]) -> AsyncIterator[UpstreamStream]:
        """POST JSON and hold the streaming answer open, failing over before the first byte."""
        content = orjson.dumps(body)
        async with self._place():
            for replica in self._order():
                try:
                    response = await self._session.post(
                        f"{replica}{path}", data=content, headers=_JSON
                    )
                except NOT_DELIVERED as exc:
                    self._failed(replica, exc)
                    continue
                try:
                    yield UpstreamStream(replica, response)
                finally:
                    response.release()
                return
        raise UpstreamUnavailable(self._none_answered())

    async def served_models(self) -> frozenset[str] | None:
        """Model names every reachable replica serves, cached; None when none answered."""
        if time.monotonic() < self._served_until:
            return self._served
        async with self._served_lock:
            if time.monotonic() >= self._served_until:
                self._served = await self._fetch_served_models()
                self._served_until = time.monotonic() + SERVED_MODELS_TTL_S
        return self._served

    def forget_served_models(self) -> None:
        """Re-read the served models on the next request (a checkpoint went missing)."""
        self._served_until = 0.0

    async def replica_health(self) -> dict[str, bool]:
        """Whether each replica answers `/health`."""
        results = await asyncio.gather(
            *(self._get(replica, "/health") for replica in self.replicas),
            return_exceptions=True,
        )
        return {
            replica: isinstance(result, tuple) and result[0] == 200
            for replica, result in zip(self.replicas, results, strict=True)
        }

    async def _fetch_served_models(self) -> frozenset[str] | None:
        results = await asyncio.gather(
            *(self._get(replica, "/v1/models") for replica in self.replicas),
            return_exceptions=True,
        )
        served: frozenset[str] | None = None
        for replica, result in zip(self.replicas, results, strict=True):
            if not isinstance(result, tuple) or result[0] != 200:
                log.warning("vLLM replica %s did not list its models: %r", replica, result)
                continue
            entries = orjson.loads(result[1]).get("data", [])
            names = frozenset(str(entry["id"]) for entry in entries)
            lengths = [
                e["max_model_len"] for e in entries if isinstance(e.get("max_model_len"), int)
            ]
            if lengths:
                shortest = min(lengths)
                self.context_tokens = min(self.context_tokens or shortest, shortest)
            served = names if served is None else served & names
        return served

    async def _get(self, replica: str, path: str) -> tuple[int, bytes]:
        # A probe does not queue behind completions (a request's model listing would add its
        # wait to the request's own): with every connection in use it fails at once.
        async with (
            self._place(wait_s=0),
            self._session.get(
                f"{replica}{path}", timeout=aiohttp.ClientTimeout(total=5.0)
            ) as response,
        ):
            return response.status, await response.read()

    def failed_midway(self, replica: str, exc: BaseException) -> None:
        """Count a replica that broke off an answer."""
        UPSTREAM_ERRORS.labels(replica, "broken").inc()
        log.warning("vLLM replica %s broke off an answer (%r)", replica, exc)

    def _failed(self, replica: str, exc: Exception) -> None:
        UPSTREAM_ERRORS.labels(replica, "connect").inc()
        log.warning("vLLM replica %s unreachable (%s); trying the next", replica, exc)

    def _none_answered(self) -> str:
        return f"no vLLM replica answered ({len(self.replicas)} tried)"
