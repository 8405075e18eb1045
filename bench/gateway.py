"""Gateway overhead: latency added and throughput, against the same upstream called directly.

Starts its own embedded Postgres, Kafka and Redis, a gateway process (`run_gateway`) and,
as the upstream, either
  fixed    a tiny OpenAI-shaped server that answers every chat completion after a fixed
           delay (default 20 ms) with a vLLM-sized body (token ids, per-token logprobs), so
           the difference between the two paths is the gateway's own cost; or
  vllm     a real vLLM server (started on --model-dir, or one already at --vllm-url).
For each upstream it sends the same open-loop load (--rate requests/s for --seconds) once
directly and once through the gateway, then a closed-loop burst for throughput, and prints
p50/p99 of both paths and their difference.

    python -m bench.gateway [--rate 100] [--seconds 20] [--delay-ms 20]
                            [--model-dir DIR | --vllm-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from app.auth.service import new_api_key
from app.db import make_engine, session_scope
from app.embedded.process import free_port, wait_for_port
from app.embedded.stack import EmbeddedStack
from app.models import Role
from app.serving.checkpoints import ensure_base_checkpoint

PROMPT = [{"role": "user", "content": "Write f(x) that returns x plus 3. " * 8}]


# -- the fixed-latency upstream (a measuring instrument, run in its own process) -------------


def fixed_completion(model: str, completion_tokens: int = 100) -> bytes:
    """A non-streaming chat completion shaped and sized like vLLM's, logprobs included."""
    rng = random.Random(0)
    tokens = [rng.randrange(32_000) for _ in range(completion_tokens)]
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "def f(x):\n    return x + 3\n"},
                    "logprobs": {
                        "content": [
                            {"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}
                            for _ in tokens
                        ]
                    },
                    "finish_reason": "stop",
                    "token_ids": tokens,
                }
            ],
            "usage": {"prompt_tokens": 300, "completion_tokens": completion_tokens},
            "prompt_token_ids": [rng.randrange(32_000) for _ in range(300)],
        }
    )


def serve_fixed_upstream(port: int, delay_ms: float) -> None:
    """Answer `/v1/chat/completions` after `delay_ms`; `/v1/models` and `/health` at once."""
    import uvicorn

    body = fixed_completion("base")
    models = orjson.dumps({"object": "list", "data": [{"id": "base", "object": "model"}]})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/chat/completions":
            await asyncio.sleep(delay_ms / 1000)
            content = body
        elif scope["path"] == "/v1/models":
            content = models
        else:
            content = b"{}"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": content})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- load -------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    latencies_ms: list[float]
    errors: int
    seconds: float

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.seconds


Sender = Callable[[aiohttp.ClientSession], Awaitable[int]]


async def open_loop(name: str, send: Sender, rate: float, seconds: float) -> Run:
    """Start one request every 1/rate seconds, whatever the answers do; time each."""
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000)) as client:
        for _ in range(10):  # warm the connections and caches
            await send(client)

        async def one() -> None:
            nonlocal errors
            started = time.perf_counter()
            status = await send(client)
            if status == 200:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                errors += 1

        tasks = []
        begin = time.perf_counter()
        for n in range(int(rate * seconds)):
            delay = begin + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
        return Run(name, latencies, errors, time.perf_counter() - begin)


async def closed_loop(name: str, send: Sender, workers: int, seconds: float) -> Run:
    """`workers` clients, each sending its next request as soon as the last is answered."""
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=workers)) as client:
        begin = time.perf_counter()
        deadline = begin + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                if await send(client) == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(workers)))
        return Run(name, latencies, errors, time.perf_counter() - begin)


def chat_sender(
    url: str, *, headers: dict[str, str], max_tokens: int, body: dict[str, Any] | None = None
) -> Sender:
    payload = orjson.dumps(body or {"model": "base", "messages": PROMPT, "max_tokens": max_tokens})
    base_headers = {**headers, "Content-Type": "application/json"}

    async def send(client: aiohttp.ClientSession) -> int:
        request_headers = {**base_headers, "X-Request-Id": f"b-{uuid.uuid4().hex}"}
        async with client.post(
            f"{url}/v1/chat/completions", data=payload, headers=request_headers
        ) as response:
            await response.read()
            return response.status

    return send


# -- processes --------------------------------------------------------------------------------


def start_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=out)


def start_gateway(
    stack: EmbeddedStack, upstream: str, data_dir: Path, port: int
) -> subprocess.Popen[bytes]:
    env = {
        **stack.environment(),
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_VLLM_URLS": upstream,
        "RTRL_GATEWAY_PORT": str(port),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    process = start_process(
        [sys.executable, "-c", "from app.main import run_gateway; run_gateway()"],
        env,
        data_dir / f"gateway-{port}.log",
    )
    wait_for_port("127.0.0.1", port, timeout=60, process=process, name="gateway")
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def report(title: str, direct: Run, gateway: Run) -> None:
    print(f"\n{title}")
    print(f"  {'':10} {'n':>6} {'err':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for run in (direct, gateway):
        print(
            f"  {run.name:10} {len(run.latencies_ms):>6} {run.errors:>4} {run.quantile(0.5):>8.2f}"
            f" {run.quantile(0.9):>8.2f} {run.quantile(0.99):>8.2f} {run.throughput:>8.1f}"
        )
    print(
        f"  {'added':10} {'':>6} {'':>4} {gateway.quantile(0.5) - direct.quantile(0.5):>8.2f}"
        f" {gateway.quantile(0.9) - direct.quantile(0.9):>8.2f}"
        f" {gateway.quantile(0.99) - direct.quantile(0.99):>8.2f}"
    )


def measure(
    label: str,
    upstream: str,
    gateway: str,
    key: str,
    *,
    rate: float,
    seconds: float,
    max_tokens: int,
    workers: int,
) -> None:
    gateway_headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "bench-session"}
    gateway_send = chat_sender(gateway, headers=gateway_headers, max_tokens=max_tokens)
    # The gateway always asks vLLM for logprobs and token ids; so does the direct call.
    direct_body = {
        "model": "base",
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    direct_send = chat_sender(upstream, headers={}, max_tokens=max_tokens, body=direct_body)
    direct = asyncio.run(open_loop("direct", direct_send, rate, seconds))
    through = asyncio.run(open_loop("gateway", gateway_send, rate, seconds))
    report(f"{label}: open loop, {rate:g} req/s for {seconds:g} s", direct, through)
    direct = asyncio.run(closed_loop("direct", direct_send, workers, seconds / 2))
    through = asyncio.run(closed_loop("gateway", gateway_send, workers, seconds / 2))
    report(f"{label}: closed loop, {workers} clients for {seconds / 2:g} s", direct, through)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--model-dir", type=Path, help="start vLLM on this model for part 2")
    parser.add_argument("--vllm-url", help="use this running vLLM (serving `base`) for part 2")
    parser.add_argument("--vllm-rate", type=float, default=5.0)
    parser.add_argument("--vllm-max-tokens", type=int, default=16)
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_fixed_upstream(args.serve_upstream, args.delay_ms)
        return

    root = Path(tempfile.mkdtemp(prefix="rtrl-bench-gateway-"))
    print(f"working in {root}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    stack = EmbeddedStack.at(
        root, postgres_port=free_port(), kafka_port=free_port(), redis_port=free_port()
    )
    processes: list[subprocess.Popen[bytes]] = []
    vllm = None
    try:
        stack.up()
        engine = make_engine(stack.url("postgres"))
        with session_scope(engine) as session:
            ensure_base_checkpoint(session, "bench")
            row, key = new_api_key(name="bench", role=Role.ide, rate_limit_per_minute=10**9)
            session.add(row)
        engine.dispose()

        upstream_port = free_port()
        upstream = f"http://127.0.0.1:{upstream_port}"
        processes.append(
            start_process(
                [
                    sys.executable,
                    "-m",
                    "bench.gateway",
                    "--serve-upstream",
                    str(upstream_port),
                    "--delay-ms",
                    str(args.delay_ms),
                ],
                {"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                root / "upstream.log",
            )
        )
        wait_for_port("127.0.0.1", upstream_port, timeout=30, name="upstream")
        gateway_port = free_port()
        processes.append(start_gateway(stack, upstream, root / "gw-fixed", gateway_port))
        measure(
            f"fixed {args.delay_ms:g} ms upstream",
            upstream,
            f"http://127.0.0.1:{gateway_port}",
            key,
            rate=args.rate,
            seconds=args.seconds,
            max_tokens=100,
            workers=args.workers,
        )
        for process in reversed(processes):
            stop(process)
        processes.clear()

        vllm_url = args.vllm_url
        if vllm_url is None and args.model_dir is not None:
            from app.serving.vllm import VllmServer

            vllm = VllmServer(model_dir=args.model_dir, port=free_port(), root=root / "vllm")
            vllm.start(timeout=600)
            vllm_url = vllm.url
        if vllm_url is None:
            print("\nreal vLLM: skipped (give --model-dir or --vllm-url)")
            return
        gateway_port = free_port()
        processes.append(start_gateway(stack, vllm_url, root / "gw-vllm", gateway_port))
        measure(
            f"real vLLM ({args.vllm_max_tokens} tokens)",
            vllm_url,
            f"http://127.0.0.1:{gateway_port}",
            key,
            rate=args.vllm_rate,
            seconds=args.seconds,
            max_tokens=args.vllm_max_tokens,
            workers=4,
        )
    finally:
        for process in reversed(processes):
            stop(process)
        if vllm is not None:
            vllm.stop()
        stack.down()
    print(f"\nlogs in {root}; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
