"""What the gateway's libraries cost per request before it does any work of its own.

Two floors under `bench.gateway`'s figures, each beside a baseline doing the same I/O with
less library in between, in one run on this machine's event loop (uvloop, as the gateway):
  redis     CPU per command of redis-py's asyncio client (the gateway's: a SET NX of a request
            id, an MGET of four run keys, a pipeline of three SETs like a turn's memory),
            with its default socket timeout (each send wrapped in `asyncio.wait_for`, which on
            Python 3.11 makes a task) and without, against the same commands written to a
            bare asyncio stream and their replies read back, on an embedded Redis;
  framework time per request of an in-process ASGI call (no socket) to an endpoint that
            reads the body and answers 8 bytes: behind the gateway's own middleware
            (request id, metrics, access log, body limit, error handlers) and a FastAPI route
            with one dependency; the same with `app.http.routes.DirectRoute`, as
            `/v1/chat/completions` is served; each route alone; a Starlette route; the
            middleware around a bare ASGI callable; a bare callable.

    python -m bench.gateway_floor [--requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from fastapi import Depends, FastAPI, Request, Response
from fastapi.routing import APIRoute
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from app.gateway.service import CHAT_PATH
from app.http.errors import BodySizeLimit, install_error_handlers
from app.http.routes import DirectRoute
from app.observability import RequestObservability
from app.processes import free_port
from rtrl.embedded.redis import HOST, EmbeddedRedis

ASGI = Callable[..., Awaitable[None]]
BODY = b'{"messages":[{"role":"user","content":"Write f(x) that returns x plus 3."}]}' * 12
ANSWER = b'{"ok":1}'


def _resp(*parts: bytes) -> bytes:
    """One Redis command in RESP, as it goes on the wire."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


async def per_call(
    call: Callable[[int], Awaitable[Any]], count: int, clock: Callable[[], float]
) -> float:
    """µs per call on `clock`, after a warm-up."""
    for n in range(min(200, count)):
        await call(n)
    started = clock()
    for n in range(count):
        await call(n)
    return (clock() - started) / count * 1e6


async def redis_floor(redis: EmbeddedRedis, count: int) -> list[tuple[str, float]]:
    """CPU per command, each command through each client."""
    value = b'{"session_id":"s","api_key_id":"k","privacy":false}'
    clients: dict[str, dict[str, Callable[[int], Awaitable[Any]]]] = {}
    opened: list[Redis] = []
    for label, timeout in (("redis-py", 5.0), ("redis-py, no socket timeout", None)):
        client = Redis.from_url(redis.url, socket_timeout=timeout, socket_connect_timeout=2)
        opened.append(client)

        async def set_nx(n: int, client: Redis = client) -> Any:
            return await client.set(f"floor:{uuid.uuid4().hex}", value, nx=True, ex=60)

        async def mget(n: int, client: Redis = client) -> Any:
            return await client.mget([f"floor:h:{n}:{k}" for k in range(4)])

        async def pipeline(n: int, client: Redis = client) -> Any:
            async with client.pipeline(transaction=False) as pipe:
                for k in range(3):
                    pipe.set(f"floor:t:{n}:{k}", value * 4, ex=60)
                return await pipe.execute()

        clients[label] = {"SET NX": set_nx, "MGET of 4": mget, "pipeline of 3 SETs": pipeline}

    reader, writer = await asyncio.open_connection(HOST, redis.port)

    async def bare(commands: list[bytes]) -> None:
        """Send the commands at once, then read a one-line reply (+OK, or nil) to each."""
        writer.write(b"".join(commands))
        for _ in commands:
            await reader.readline()

    async def bare_set(n: int) -> None:
        await bare([_resp(b"SET", uuid.uuid4().hex.encode(), value, b"NX", b"EX", b"60")])

    async def bare_mget(n: int) -> None:
        keys = [f"floor:h:{n}:{k}".encode() for k in range(4)]
        writer.write(_resp(b"MGET", *keys))
        items = int((await reader.readline())[1:])  # an array: nil, or a length and a value
        for _ in range(items):
            if not (await reader.readline()).startswith(b"$-1"):
                await reader.readline()

    async def bare_pipeline(n: int) -> None:
        await bare(
            [_resp(b"SET", f"floor:t:{n}:{k}".encode(), value * 4, b"EX", b"60") for k in range(3)]
        )

    clients["bare stream"] = {
        "SET NX": bare_set,
        "MGET of 4": bare_mget,
        "pipeline of 3 SETs": bare_pipeline,
    }
    rows = [
        (f"{label}: {command}", await per_call(call, count, time.process_time))
        for label, commands in clients.items()
        for command, call in commands.items()
    ]
    writer.close()
    for client in opened:
        await client.aclose()
    return rows


def framework_apps() -> dict[str, ASGI]:
    async def principal(request: Request) -> str:
        return request.headers.get("authorization", "")

    async def read_and_answer(request: Request) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json", headers={"X-Rtrl-Checkpoint": "c"})

    def fastapi_app(middleware: bool, route_class: type[APIRoute] = APIRoute) -> FastAPI:
        app = FastAPI()

        async def chat(request: Request, _: str = Depends(principal)) -> Response:
            return await read_and_answer(request)

        app.router.add_api_route(
            CHAT_PATH,
            chat,
            methods=["POST"],
            response_model=None,
            route_class_override=route_class,
        )

        if middleware:  # as app.main.create_app adds them
            install_error_handlers(app)
            app.add_middleware(BodySizeLimit, max_bytes=1 << 20)
            app.add_middleware(RequestObservability)
        return app

    async def starlette_endpoint(request: Request) -> Response:
        await principal(request)
        return await read_and_answer(request)

    async def bare(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"application/json"), (b"x-rtrl-checkpoint", b"c")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ANSWER})

    return {
        "FastAPI route + the gateway's middleware": fastapi_app(middleware=True),
        "DirectRoute + the gateway's middleware": fastapi_app(True, DirectRoute),
        "FastAPI route": fastapi_app(middleware=False),
        "DirectRoute": fastapi_app(False, DirectRoute),
        "Starlette route": Starlette(
            routes=[Route(CHAT_PATH, starlette_endpoint, methods=["POST"])]
        ),
        "the gateway's middleware + bare ASGI": RequestObservability(
            BodySizeLimit(bare, max_bytes=1 << 20)
        ),
        "bare ASGI": bare,
    }


async def framework_floor(count: int) -> list[tuple[str, float]]:
    headers = [
        (b"host", b"gateway"),
        (b"content-type", b"application/json"),
        (b"authorization", b"Bearer rtrl-key"),
        (b"content-length", str(len(BODY)).encode()),
    ]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message

    rows = []
    for label, app in framework_apps().items():

        async def call(n: int, app: ASGI = app) -> None:
            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": CHAT_PATH,
                "raw_path": CHAT_PATH.encode(),
                "query_string": b"",
                "root_path": "",
                "headers": headers,
                "client": ("127.0.0.1", 50000),
                "server": ("127.0.0.1", 8000),
            }
            await app(scope, receive, send)

        rows.append((label, await per_call(call, count, time.perf_counter)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-floor-") as root:
        redis = EmbeddedRedis(Path(root) / "redis", free_port())
        redis.start()
        try:
            rows = uvloop.run(redis_floor(redis, args.requests))
        finally:
            redis.stop()
    print(f"Redis, µs of CPU per command (this process; {args.requests} each, uvloop)")
    for label, value in rows:
        print(f"  {label:45s} {value:7.0f}")
    print(f"\nframework, µs per request (in-process ASGI, no socket; {args.requests} each, uvloop)")
    for label, value in uvloop.run(framework_floor(args.requests)):
        print(f"  {label:45s} {value:7.0f}")


if __name__ == "__main__":
    main()
