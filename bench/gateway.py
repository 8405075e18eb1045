"""Gateway overhead as an outside client sees it: latency added at a constant request rate.

Starts its own embedded Postgres, Kafka and Redis, a fixed-latency upstream (a tiny
OpenAI-shaped server that answers every chat completion after --delay-ms with a vLLM-sized
body: 100 completion tokens, their ids and logprobs; streamed in --stream-chunks chunks when
asked) and a gateway process in front of it, with two checkpoints in a running 50/50
experiment. The load comes from `hey` (Go, apt package `hey`; installed with apt-get when
missing), so the load generator does not compete for the gateway's interpreter, and the
feedback traffic from `curl`, one unique batch per POST at --feedback-rate batches/s.

Each round measures, in alternating order, the upstream called directly and the gateway in
front of it: non-streaming (hey's total time per request) and streaming (hey's
"response-delay": request written to first response byte, TTFB, and the total). Feedback
is posted to the gateway while the gateway is measured. Then a sweep of rates finds the
highest at which the p99 added stays within --p99-budget-ms. With --profile, py-spy samples
the gateway through one more non-streaming and one more streaming phase and the report
ends with the frames that took its time.

    python -m bench.gateway [--rate 100] [--seconds 20] [--rounds 3] [--delay-ms 20]
                            [--feedback-rate 10] [--sweep 100,200,300,400,500]
                            [--gateway-workers 1] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import io
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from app.auth.service import new_api_key
from app.db import make_engine, session_scope
from app.embedded.process import free_port, wait_for_port
from app.embedded.stack import EmbeddedStack
from app.models import Checkpoint, CheckpointStatus, Role
from app.registry.experiments import start_canary
from app.serving.checkpoints import ensure_base_checkpoint

PROMPT = [{"role": "user", "content": "Write f(x) that returns x plus 3. " * 8}]
CHECKPOINTS = ("base", "ckpt-1")
COMPLETION_TOKENS = 100
ROOT = Path(__file__).resolve().parents[1]
SESSION_ID = "bench-session"
PROFILE_HZ = 200
PERIOD_S = 0.1
"""Each hey process (one connection) sends one request per PERIOD_S: far above the
latencies measured, so a process rarely waits for an answer past its next tick."""


# -- the fixed-latency upstream (a measuring instrument, run in its own process) -------------


def _logprob_entries(count: int) -> list[dict[str, Any]]:
    return [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}] * count


def fixed_completion(model: str) -> bytes:
    """A non-streaming chat completion shaped and sized like vLLM's, logprobs included."""
    tokens = [(7919 * n) % 32_000 for n in range(COMPLETION_TOKENS)]
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
                    "logprobs": {"content": _logprob_entries(COMPLETION_TOKENS)},
                    "finish_reason": "stop",
                    "token_ids": tokens,
                }
            ],
            "usage": {"prompt_tokens": 300, "completion_tokens": COMPLETION_TOKENS},
            "prompt_token_ids": [(104_729 * n) % 32_000 for n in range(300)],
        }
    )


def fixed_stream(model: str, chunks: int) -> list[bytes]:
    """The same completion as vLLM streams it: SSE chunks of a few tokens each, then [DONE]."""
    per_chunk = max(1, COMPLETION_TOKENS // chunks)
    events = []
    for n in range(chunks):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": "x + 3 " if n else "def f(x): "},
            "logprobs": {"content": _logprob_entries(per_chunk)},
            "finish_reason": "stop" if n == chunks - 1 else None,
            "token_ids": [(7919 * (n * per_chunk + i)) % 32_000 for i in range(per_chunk)],
        }
        chunk: dict[str, Any] = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [choice],
        }
        if n == 0:
            chunk["prompt_token_ids"] = [(104_729 * i) % 32_000 for i in range(300)]
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def serve_fixed_upstream(port: int, delay_ms: float, chunks: int, chunk_gap_ms: float) -> None:
    """Answer `/v1/chat/completions` after `delay_ms` (the first chunk, when streaming, then
    one chunk every `chunk_gap_ms`); `/v1/models` (both checkpoints) and `/health` at once."""
    import uvicorn

    bodies = {model: fixed_completion(model) for model in CHECKPOINTS}
    streams = {model: fixed_stream(model, chunks) for model in CHECKPOINTS}
    models = orjson.dumps(
        {"object": "list", "data": [{"id": m, "object": "model"} for m in CHECKPOINTS]}
    )
    json_headers = [(b"content-type", b"application/json")]
    sse_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] != "/v1/chat/completions":
            content = models if scope["path"] == "/v1/models" else b"{}"
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": content})
            return
        request = orjson.loads(raw)
        model = request.get("model") if request.get("model") in bodies else CHECKPOINTS[0]
        await asyncio.sleep(delay_ms / 1000)
        if not request.get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": bodies[model]})
            return
        # The headers leave with the first token, as a model server's first chunk would.
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        events = streams[model]
        for n, event in enumerate(events):
            if n and n < len(events) - 1:
                await asyncio.sleep(chunk_gap_ms / 1000)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_bare_proxy(port: int, upstream: str) -> None:
    """Pass every request to `upstream` and its answer back, streamed as it comes, with the
    gateway's server and client (uvicorn with uvloop and httptools, aiohttp) and nothing else:
    what the extra hop costs before the gateway does any work."""
    import aiohttp
    import uvicorn

    client: aiohttp.ClientSession | None = None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal client
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if client is None:
            client = aiohttp.ClientSession(skip_auto_headers=("User-Agent",))
        async with client.post(
            f"{upstream}{scope['path']}", data=raw, headers={"content-type": "application/json"}
        ) as response:
            headers = [(b"content-type", response.headers["content-type"].encode())]
            await send(
                {"type": "http.response.start", "status": response.status, "headers": headers}
            )
            async for data in response.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- load: hey processes and a curl feedback stream -------------------------------------------


def ensure_tools() -> None:
    """`hey` and `curl` on PATH; installed with apt-get when missing (Debian/Ubuntu, as root)."""
    missing = [tool for tool in ("hey", "curl") if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        sys.exit(f"error: {', '.join(missing)} not found; install them (apt-get install hey curl)")
    print(f"installing {' '.join(missing)} with apt-get", flush=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, capture_output=True)


@dataclass
class Sample:
    """One request as hey timed it."""

    total_ms: float
    first_byte_ms: float
    status: int


@dataclass
class Phase:
    """One measured stretch of load on one target."""

    target: str
    kind: str
    rate: float
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    @property
    def achieved(self) -> float:
        return len(self.samples) / self.seconds

    def quantile(self, q: float, first_byte: bool = False) -> float:
        values = [s.first_byte_ms if first_byte else s.total_ms for s in self.ok]
        return quantile(values, q)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    headers: tuple[str, ...]
    body: dict[str, Any]


def hey_processes(rate: float) -> int:
    return max(2, min(40, math.ceil(rate * PERIOD_S)))


def run_hey(
    target: Target,
    *,
    stream: bool,
    rate: float,
    seconds: float,
    users: list[str],
    work: Path,
    side_load: list[list[str]] | None = None,
) -> Phase:
    """`rate` requests/s for `seconds` from several single-connection hey processes started
    one after the other, so their ticks interleave instead of arriving in bursts."""
    work.mkdir(parents=True, exist_ok=True)
    body_file = work / f"{target.name}-{'stream' if stream else 'plain'}.json"
    body_file.write_bytes(orjson.dumps({**target.body, "stream": stream}))
    count = hey_processes(rate)
    side = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for command in side_load or []]
    processes = []
    for n in range(count):
        headers = [*target.headers]
        if target.name == "gateway":
            headers += ["-H", f"X-User-Id: {users[n % len(users)]}"]
        command = [
            "hey",
            *("-z", f"{seconds:g}s", "-c", "1", "-q", f"{rate / count:.4f}", "-t", "10"),
            *("-m", "POST", "-T", "application/json", "-D", str(body_file), "-o", "csv"),
            *headers,
            f"{target.url}/v1/chat/completions",
        ]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
        time.sleep(1 / rate)
    phase = Phase(target.name, "stream" if stream else "plain", rate, seconds)
    for process in processes:
        output, _ = process.communicate(timeout=seconds + 60)
        rows = list(csv.reader(io.StringIO(output)))[2:]  # the header; the connection's first
        for row in rows:
            if len(row) >= 7 and row[0] != "response-time":
                phase.samples.append(
                    Sample(float(row[0]) * 1000, float(row[4]) * 1000, int(row[6]))
                )
    for side_process in side:
        side_process.wait(timeout=seconds + 60)
    return phase


def feedback_config(
    path: Path, gateway: str, key: str, request_ids: list[str], batches: int
) -> None:
    """A curl config of `batches` POSTs to /v1/feedback, each a new batch of two events."""
    entries = []
    for n in range(batches):
        request_id = request_ids[n % len(request_ids)]
        events: list[dict[str, Any]] = [
            {"kind": "edit_accepted", "event_id": str(uuid.uuid4())},
            {
                "kind": "edit_survival",
                "event_id": str(uuid.uuid4()),
                "elapsed_s": 30,
                "surviving_share": 0.9,
            },
        ]
        body = orjson.dumps(
            {"events": [e | {"session_id": SESSION_ID, "request_id": request_id} for e in events]}
        ).decode()
        entries.append(
            "\n".join(
                [
                    f'url = "{gateway}/v1/feedback"',
                    f'header = "Authorization: Bearer {key}"',
                    'header = "Content-Type: application/json"',
                    'data = "{}"'.format(body.replace("\\", "\\\\").replace('"', '\\"')),
                    'output = "/dev/null"',
                    'write-out = "%{http_code} %{time_total}\\n"',
                ]
            )
        )
    path.write_text("\nnext\n".join(entries) + "\n")


def feedback_command(config: Path, rate: float, out: Path) -> list[str]:
    return ["sh", "-c", f"curl -s --rate {rate:g}/s -K {config} > {out}"]


def read_feedback(path: Path) -> tuple[list[float], int]:
    latencies, errors = [], 0
    for line in path.read_text().split("\n"):
        status, _, seconds = line.partition(" ")
        if not seconds:
            continue
        if status == "202":
            latencies.append(float(seconds) * 1000)
        else:
            errors += 1
    return latencies, errors


# -- processes --------------------------------------------------------------------------------


def start_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=out)


def start_gateway(
    stack: EmbeddedStack, upstream: str, data_dir: Path, port: int, workers: int
) -> subprocess.Popen[bytes]:
    env = {
        **stack.environment(),
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_VLLM_URLS": upstream,
        "RTRL_GATEWAY_PORT": str(port),
        "PYTHONPATH": str(ROOT),
    }
    process = start_process(
        [sys.executable, "-c", f"from app.main import run_gateway; run_gateway(workers={workers})"],
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


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> str:
    """POST once; the checkpoint that answered."""
    request = urllib.request.Request(
        url, data=orjson.dumps(body), headers={**headers, "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        return str(response.headers["X-Rtrl-Checkpoint"])


def served_by_checkpoint(gateway: str) -> dict[str, float]:
    """Completions the gateway served so far, by checkpoint (from its /metrics)."""
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=10) as response:
        text = response.read().decode()
    served: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if line.startswith("rtrl_completions_total{"):
            labels, _, value = line.partition("} ")
            checkpoint = labels.split('checkpoint="')[1].split('"')[0]
            served[checkpoint] += int(float(value))
    return {name: float(count) for name, count in served.items()}


# -- the bench --------------------------------------------------------------------------------


@dataclass
class Setup:
    stack: EmbeddedStack
    key: str
    root: Path
    direct: Target
    proxy: Target
    """A bare pass-through proxy (uvicorn and aiohttp, as the gateway): the hop's own cost."""
    gateway: Target
    users: list[str]
    request_ids: list[str]
    gateway_process: subprocess.Popen[bytes] | None = None


def prepare_registry(stack: EmbeddedStack) -> str:
    """The base checkpoint in production, `ckpt-1` in a 50/50 experiment, an ide key."""
    engine = make_engine(stack.url("postgres"))
    try:
        with session_scope(engine) as session:
            base = ensure_base_checkpoint(session, "bench")
            canary = Checkpoint(
                name=CHECKPOINTS[1], status=CheckpointStatus.candidate, base_model="bench"
            )
            session.add(canary)
            session.flush()
            start_canary(
                session, control=base, treatment=canary, treatment_bps=5000, created_by="bench"
            )
            row, key = new_api_key(name="bench", role=Role.ide, rate_limit_per_minute=10**9)
            session.add(row)
    finally:
        engine.dispose()
    return key


def interleaved(
    setup: Setup,
    targets: list[Target],
    *,
    stream: bool,
    rate: float,
    seconds: float,
    round_number: int,
    args: Any,
) -> tuple[dict[str, Phase], list[float], int]:
    """One phase per target, the order rotated each round; feedback is posted to the gateway
    while it is measured."""
    shift = round_number % len(targets)
    order = targets[shift:] + targets[:shift]
    phases: dict[str, Phase] = {}
    feedback: tuple[list[float], int] = ([], 0)
    work = setup.root / f"round-{round_number}-{'stream' if stream else 'plain'}-{rate:g}"
    for target in order:
        side = []
        if target.name == "gateway" and args.feedback_rate > 0:
            config = work / "feedback.cfg"
            work.mkdir(parents=True, exist_ok=True)
            batches = int(args.feedback_rate * seconds)
            feedback_config(config, setup.gateway.url, setup.key, setup.request_ids, batches)
            side.append(feedback_command(config, args.feedback_rate, work / "feedback.out"))
        phases[target.name] = run_hey(
            target,
            stream=stream,
            rate=rate,
            seconds=seconds,
            users=setup.users,
            work=work,
            side_load=side,
        )
        if side:
            feedback = read_feedback(work / "feedback.out")
    return phases, feedback[0], feedback[1]


def added(direct: Phase, gateway: Phase, q: float, first_byte: bool = False) -> float:
    return gateway.quantile(q, first_byte) - direct.quantile(q, first_byte)


def print_rounds(
    title: str, rounds: list[dict[str, Phase]], *, first_byte: bool = False
) -> tuple[float, float]:
    """Per round: the direct call, and what the bare proxy and the gateway add to it."""
    print(f"\n{title}")
    print(
        f"  {'round':>5} {'direct p50':>10} {'p99':>6} │ {'proxy +p50':>10} {'+p99':>6} │"
        f" {'gateway p50':>11} {'p99':>6} {'+p50':>6} {'+p99':>6} │ {'req/s':>6} {'errors':>6}"
    )
    added50, added99 = [], []
    for n, phases in enumerate(rounds, start=1):
        direct, proxy, gateway = phases["direct"], phases["proxy"], phases["gateway"]
        a50, a99 = added(direct, gateway, 0.5, first_byte), added(direct, gateway, 0.99, first_byte)
        added50.append(a50)
        added99.append(a99)
        print(
            f"  {n:>5} {direct.quantile(0.5, first_byte):>10.1f}"
            f" {direct.quantile(0.99, first_byte):>6.1f} │"
            f" {added(direct, proxy, 0.5, first_byte):>10.1f}"
            f" {added(direct, proxy, 0.99, first_byte):>6.1f} │"
            f" {gateway.quantile(0.5, first_byte):>11.1f}"
            f" {gateway.quantile(0.99, first_byte):>6.1f} {a50:>6.1f} {a99:>6.1f} │"
            f" {gateway.achieved:>6.1f} {sum(p.errors for p in phases.values()):>6}"
        )
    median50, median99 = statistics.median(added50), statistics.median(added99)
    proxy50 = statistics.median(added(r["direct"], r["proxy"], 0.5, first_byte) for r in rounds)
    proxy99 = statistics.median(added(r["direct"], r["proxy"], 0.99, first_byte) for r in rounds)
    print(
        f"  {'median':>5} {'':>10} {'':>6} │ {proxy50:>10.1f} {proxy99:>6.1f} │"
        f" {'':>11} {'':>6} {median50:>6.1f} {median99:>6.1f} │"
    )
    return median50, median99


def sweep(setup: Setup, rates: list[float], args: Any) -> list[tuple[float, Phase, Phase]]:
    results = []
    for n, rate in enumerate(rates):
        phases, _, _ = interleaved(
            setup,
            [setup.direct, setup.gateway],
            stream=False,
            rate=rate,
            seconds=args.sweep_seconds,
            round_number=100 + n,
            args=args,
        )
        results.append((rate, phases["direct"], phases["gateway"]))
    return results


def profile(setup: Setup, args: Any) -> None:
    """py-spy on the gateway through a non-streaming and a streaming phase; top frames."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("\nprofile: skipped (pip install py-spy, or the dev extra)")
        return
    assert setup.gateway_process is not None
    pid = setup.gateway_process.pid
    for stream in (False, True):
        raw = setup.root / f"profile-{'stream' if stream else 'plain'}.txt"
        spy = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--subprocesses",
                "--format",
                "raw",
                "--rate",
                str(PROFILE_HZ),
                "--nonblocking",
                "--duration",
                f"{args.seconds:g}",
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        run_hey(
            setup.gateway,
            stream=stream,
            rate=args.rate,
            seconds=args.seconds - 2,
            users=setup.users,
            work=setup.root / "profile",
        )
        spy.wait(timeout=args.seconds + 60)
        print(
            f"\nprofile of the gateway, {'streaming' if stream else 'non-streaming'} at "
            f"{args.rate:g} req/s (py-spy, {raw})"
        )
        print_profile(raw, args.seconds)


def print_profile(raw: Path, seconds: float, top: int = 18) -> None:
    """The frames that took the most samples: by own time, and inclusive of their callees.

    py-spy leaves out the samples of threads that wait (in epoll, on a lock): every sample
    is a thread running or runnable, so on a busy machine time queued for a CPU counts too.
    """
    if not raw.exists():
        print("  (no samples: py-spy could not attach; it needs ptrace rights)")
        return
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    parts: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        if stack.startswith("process ") and '";' in stack:  # its command line may hold ";"
            stack = stack[stack.index('";') + 2 :]
        frames = [_short(frame) for frame in stack.split(";")]
        busy += count
        parts[_part(stack, frames[-1])] += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not busy:
        print("  (no samples)")
        return
    print(
        f"  {busy} samples at {PROFILE_HZ} Hz: threads running or runnable for "
        f"{busy / PROFILE_HZ:.1f} s in {seconds:g} s; their shares:"
    )
    print("  by part:")
    for part, count in parts.most_common():
        print(f"    {100 * count / busy:5.1f}%  {part}")
    print("  own time:")
    for frame, count in own.most_common(top):
        print(f"    {100 * count / busy:5.1f}%  {frame}")
    print("  inclusive:")
    for frame, count in inclusive.most_common(top):
        if not frame.startswith(("<module>", "run ", "_run ", "run_forever", "_bootstrap")):
            print(f"    {100 * count / busy:5.1f}%  {frame}")


# Where a sample's time went, by the first marker its stack holds.
_PARTS = (
    ("Sender.run (kafka/", "the Kafka producer's thread"),
    ("EventSink._run (", "the event sink's thread: spool reads, fsyncs, sends"),
    ("redis/", "Redis commands (redis-py)"),
    ("aiohttp/", "the call to the upstream (aiohttp)"),
    ("RequestResponseCycle.send (", "writes to the client (uvicorn)"),
    ("EventSink.publish (", "the event: encode, spool append"),
    ("completion_event (", "the event: build and validate"),
    ("Gateway.complete (", "the answer: parse, record, client view"),
    ("Gateway._relay", "the stream: parse, record, client view"),
    ("dependencies.py", "auth and rate limit"),
    ("_chat_body (", "the request: parse and validate"),
    ("observability.py", "metrics and access-log middleware"),
)


def _part(stack: str, innermost: str) -> str:
    for marker, part in _PARTS:
        if marker in stack:
            return part
    if innermost.startswith("Runner.run "):
        return "the event loop's own C code (uvloop: sockets, callbacks)"
    return "other (framework routing, middleware, tasks)"


def _short(frame: str) -> str:
    """`function (path/to/module.py:line)` → `function (module.py)`."""
    name, _, location = frame.partition(" (")
    path = location.rstrip(")").rsplit(":", 1)[0]
    for prefix in ("site-packages/", str(ROOT) + "/"):
        if prefix in path:
            path = path.split(prefix, 1)[1]
    return f"{name} ({path})"


def setup_load(stack: EmbeddedStack, key: str, root: Path, args: Any) -> Setup:
    upstream_port, gateway_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{upstream_port}"
    gateway = f"http://127.0.0.1:{gateway_port}"
    direct_body = {
        # The gateway always asks vLLM for logprobs and token ids; so does the direct call.
        "model": CHECKPOINTS[0],
        "messages": PROMPT,
        "max_tokens": COMPLETION_TOKENS,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    return Setup(
        stack=stack,
        key=key,
        root=root,
        direct=Target("direct", upstream, (), direct_body),
        proxy=Target("proxy", f"http://127.0.0.1:{free_port()}", (), direct_body),
        gateway=Target(
            "gateway",
            gateway,
            ("-H", f"Authorization: Bearer {key}", "-H", f"X-Session-Id: {SESSION_ID}"),
            {"model": "rtrl", "messages": PROMPT, "max_tokens": COMPLETION_TOKENS},
        ),
        users=[],
        request_ids=[],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s (default 100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase (default 20)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="upstream time to answer")
    parser.add_argument("--stream-chunks", type=int, default=20)
    parser.add_argument("--chunk-gap-ms", type=float, default=1.0)
    parser.add_argument("--feedback-rate", type=float, default=10.0, help="batches/s")
    parser.add_argument("--sweep", default="100,200,300,400,500", help="rates; empty: none")
    parser.add_argument("--sweep-seconds", type=float, default=10.0)
    parser.add_argument("--p99-budget-ms", type=float, default=10.0)
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="py-spy the gateway at the end")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--proxy-upstream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_proxy:
        serve_bare_proxy(args.serve_proxy, args.proxy_upstream)
        return
    if args.serve_upstream:
        serve_fixed_upstream(
            args.serve_upstream, args.delay_ms, args.stream_chunks, args.chunk_gap_ms
        )
        return
    try:
        rates = [float(rate) for rate in args.sweep.split(",") if rate.strip()]
    except ValueError:
        parser.error(f"--sweep takes comma-separated rates, not {args.sweep!r}")
    if args.rate <= 0 or args.seconds < 5 or args.rounds < 1 or any(r <= 0 for r in rates):
        parser.error("--rate and --sweep rates must be positive, --seconds at least 5")
    ensure_tools()

    root = Path(tempfile.mkdtemp(prefix="rtrl-bench-gateway-"))
    print(
        f"working in {root}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    stack = EmbeddedStack.at(
        root, postgres_port=free_port(), kafka_port=free_port(), redis_port=free_port()
    )
    processes: list[subprocess.Popen[bytes]] = []
    try:
        stack.up()
        key = prepare_registry(stack)
        setup = setup_load(stack, key, root, args)
        upstream_port = int(setup.direct.url.rsplit(":", 1)[1])
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
                    "--stream-chunks",
                    str(args.stream_chunks),
                    "--chunk-gap-ms",
                    str(args.chunk_gap_ms),
                ],
                {"PYTHONPATH": str(ROOT)},
                root / "upstream.log",
            )
        )
        wait_for_port("127.0.0.1", upstream_port, timeout=30, name="upstream")
        proxy_port = int(setup.proxy.url.rsplit(":", 1)[1])
        processes.append(
            start_process(
                [
                    *(sys.executable, "-m", "bench.gateway", "--serve-proxy", str(proxy_port)),
                    *("--proxy-upstream", setup.direct.url),
                ],
                {"PYTHONPATH": str(ROOT)},
                root / "proxy.log",
            )
        )
        wait_for_port("127.0.0.1", proxy_port, timeout=30, name="proxy")
        gateway_port = int(setup.gateway.url.rsplit(":", 1)[1])
        setup.gateway_process = start_gateway(
            stack, setup.direct.url, root / "gateway", gateway_port, args.gateway_workers
        )
        processes.append(setup.gateway_process)
        headers = {"Authorization": f"Bearer {key}", "X-Session-Id": SESSION_ID}
        # Completions the feedback will be about, from users whose arms the gateway tells;
        # the load then comes from as many users of each arm. Warms the caches too.
        arms: dict[str, list[str]] = collections.defaultdict(list)
        for n in range(64):
            request_id, user = f"bench-{uuid.uuid4().hex[:12]}", f"bench-user-{n}"
            checkpoint = post(
                f"{setup.gateway.url}/v1/chat/completions",
                setup.gateway.body,
                headers | {"X-Request-Id": request_id, "X-User-Id": user},
            )
            arms[checkpoint].append(user)
            setup.request_ids.append(request_id)
        setup.users = [user for pair in zip(*arms.values(), strict=False) for user in pair]
        if len(arms) != len(CHECKPOINTS):
            print(f"warning: 64 users all went to {', '.join(arms)}", flush=True)
            setup.users = [user for users in arms.values() for user in users]
        for stream in (False, True):  # the gateway's first seconds: connections, imports
            run_hey(
                setup.gateway,
                stream=stream,
                rate=args.rate,
                seconds=5,
                users=setup.users,
                work=root / "warm-up",
            )
        report(setup, rates, args)
    finally:
        for process in reversed(processes):
            stop(process)
        stack.down()
    print(f"\nlogs in {root}; load average now {os.getloadavg()[0]:.1f}")


def report(setup: Setup, rates: list[float], args: Any) -> None:
    print(
        f"\nfixed {args.delay_ms:g} ms upstream, {COMPLETION_TOKENS} completion tokens with "
        f"logprobs (streamed in {args.stream_chunks} chunks, {args.chunk_gap_ms:g} ms apart); "
        f"{args.rate:g} req/s from {hey_processes(args.rate)} hey processes for "
        f"{args.seconds:g} s a phase; feedback {args.feedback_rate:g} batches/s (curl) during "
        f"the gateway's phases; gateway workers: {args.gateway_workers}",
        flush=True,
    )
    plain: list[dict[str, Phase]] = []
    streamed: list[dict[str, Phase]] = []
    feedback: list[float] = []
    feedback_errors = 0
    for n in range(args.rounds):
        for stream, rounds in ((False, plain), (True, streamed)):
            phases, latencies, errors = interleaved(
                setup,
                [setup.direct, setup.proxy, setup.gateway],
                stream=stream,
                rate=args.rate,
                seconds=args.seconds,
                round_number=n,
                args=args,
            )
            rounds.append(phases)
            feedback += latencies
            feedback_errors += errors
        print(f"  round {n + 1} of {args.rounds} done", flush=True)
    print_rounds(f"non-streaming, {args.rate:g} req/s: total time (ms)", plain)
    print_rounds(
        f"streaming, {args.rate:g} req/s: time to first byte (ms)", streamed, first_byte=True
    )
    print_rounds(f"streaming, {args.rate:g} req/s: total time (ms)", streamed)
    print(
        f"\nfeedback (curl, {args.feedback_rate:g} batches/s of 2 events): {len(feedback)} "
        f"accepted, {feedback_errors} errors, p50 {quantile(feedback, 0.5):.1f} ms, "
        f"p99 {quantile(feedback, 0.99):.1f} ms"
    )
    served = served_by_checkpoint(setup.gateway.url)
    print(
        "completions by checkpoint (50/50 experiment): "
        + ", ".join(f"{name} {count:.0f}" for name, count in sorted(served.items()))
    )
    if rates:
        print(f"\nsweep, non-streaming, {args.sweep_seconds:g} s a phase (ms)")
        print(
            f"  {'rate':>5} {'direct p50':>10} {'p99':>7} {'gateway p50':>11} {'p99':>7}"
            f" {'added p50':>9} {'p99':>7} {'req/s':>6} {'errors':>6}"
        )
        best = None
        for rate, direct, gateway in sweep(setup, rates, args):
            a99 = added(direct, gateway, 0.99)
            print(
                f"  {rate:>5g} {direct.quantile(0.5):>10.1f} {direct.quantile(0.99):>7.1f}"
                f" {gateway.quantile(0.5):>11.1f} {gateway.quantile(0.99):>7.1f}"
                f" {added(direct, gateway, 0.5):>9.1f} {a99:>7.1f} {gateway.achieved:>6.1f}"
                f" {direct.errors + gateway.errors:>6}",
                flush=True,
            )
            if a99 <= args.p99_budget_ms and gateway.achieved >= 0.95 * rate:
                best = rate if best is None else max(best, rate)
        print(
            f"  highest rate with p99 added ≤ {args.p99_budget_ms:g} ms: "
            + (f"{best:g} req/s" if best is not None else "none of those swept")
        )
    if args.profile:
        profile(setup, args)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
