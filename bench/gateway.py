"""Gateway overhead as an outside client sees it: latency added at a constant request rate.

Starts its own embedded Postgres, Kafka and Redis, a fixed-latency upstream (a tiny
OpenAI-shaped server that answers every chat completion after --delay-ms with a vLLM-sized
body: 100 completion tokens, their ids and logprobs, the prompt's token ids; a tool call when
the request declares tools; streamed in --stream-chunks chunks when asked) and a gateway
process in front of it, with two checkpoints in a running 50/50 experiment. The load comes
from `hey` (Go, apt package `hey`; installed with apt-get when missing), so the load
generator does not compete for the gateway's interpreter, and the feedback traffic from
`curl`, one batch per POST at --feedback-rate batches/s, each about a completion of its
own, served before the phase's clock starts (a request takes one verdict; a second is a 409).

What the clients send (--workloads): chats and agent turns (six tools declared, each with a
JSON Schema), each either a session's first turn (no session header, as stock clients send,
from 64 users of both arms) or late in a long session (one session id and one X-User-Id per
arm, as an IDE sends them; the request is the run's seventh turn, its history holding the
six earlier answers and their tool results, whose turns were served first, so the run lookup
finds its parent and the token prefix lines up). Not measured unless named: the fresh agent
turn as Claude Code sends it to `/v1/messages` (messages-agent-fresh: text blocks, the tools
with an `input_schema`, `x-api-key`) and as Codex sends it to `/v1/responses`
(responses-agent-fresh: input items, `store: false`), each timed against the chat body the
gateway translates it into (agent-fresh's) sent to the upstream directly: what the surface
adds. Each workload's request is sent through the gateway once, whole and streamed, before the
load; any answer but a 200 ends the bench.

Each round measures, in rotating order, each workload's request sent to the upstream
directly and through the gateway, and the first workload through a bare proxy:
non-streaming (hey's total time per request) and streaming (hey's "response-delay": request
written to first response byte, TTFB, and the total). Feedback is posted to the gateway
while the gateway is measured, and the gateway's CPU time per request is read from /proc.
A table then puts the workloads side by side against the budget (--p50-budget-ms,
--p99-budget-ms), and another the gateway's own time to the first byte, read from its
`rtrl_http_overhead_seconds` histogram during each phase (interpolated within a bucket:
0.25 ms wide up to 4 ms): what the client sees added, less the hop and the time the request
waited outside the app. Then a sweep of rates finds the highest at which the plain chat's p99
added stays within --p99-budget-ms. With --profile, py-spy samples the gateway (the thread
holding the GIL) through one more non-streaming and one more streaming phase of each
workload and the report ends with the frames that took its time.

    python -m bench.gateway [--rate 100] [--seconds 15] [--rounds 2] [--delay-ms 20]
                            [--workloads chat-fresh,chat-long,agent-fresh,agent-long]
                            [--feedback-rate 10] [--sweep 100,200,300,400,500]
                            [--gateway-workers 1] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import csv
import dataclasses
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
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample as MetricSample

from app.auth.service import new_api_key
from app.db import make_engine, session_scope
from app.gateway.service import CHAT_PATH
from app.models import Checkpoint, CheckpointStatus, Role
from app.processes import free_port, wait_for_port
from app.registry.experiments import start_canary
from app.serving.publish import ensure_base_checkpoint
from bench._stack import scratch_stack
from rtrl.embedded.stack import EmbeddedStack

CHECKPOINTS = ("base", "ckpt-1")
COMPLETION_TOKENS = 100
ROOT = Path(__file__).resolve().parents[1]
SESSION_ID = "bench-session"
PROFILE_HZ = 200
PERIOD_S = 0.1
"""Each hey process (one connection) sends one request per PERIOD_S: far above the
latencies measured, so a process rarely waits for an answer past its next tick."""


# -- the workloads: what the clients send --------------------------------------------------

SYSTEM_PROMPT = (
    "You are a coding agent working in the user's repository. Read before you edit; make the "
    "smallest change that does what was asked; run the tests after every edit and read their "
    "output; never invent file contents you have not read. Call one tool at a time and wait "
    "for its result. When the task is done, say what you changed in one short paragraph. "
) * 6


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> Any:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def _text(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


TOOLS = [
    _tool(
        "read_file",
        "Read a file of the workspace, or some of its lines. Returns the text with line numbers.",
        {
            "path": _text("Path relative to the workspace root."),
            "start_line": {"type": "integer", "minimum": 1, "description": "First line (1)."},
            "end_line": {"type": "integer", "minimum": 1, "description": "Last line (end)."},
        },
        ["path"],
    ),
    _tool(
        "edit_file",
        "Replace one exact occurrence of old_text by new_text in a file. Fails when old_text "
        "occurs zero times or more than once: include enough context to make it unique.",
        {
            "path": _text("Path relative to the workspace root."),
            "old_text": _text("The exact text to replace, whitespace included."),
            "new_text": _text("The text that replaces it."),
        },
        ["path", "old_text", "new_text"],
    ),
    _tool(
        "list_directory",
        "List the files and directories under a path.",
        {
            "path": _text("Path relative to the workspace root."),
            "recursive": {"type": "boolean", "description": "Descend into subdirectories."},
        },
        ["path"],
    ),
    _tool(
        "search_code",
        "Search the workspace for a regular expression; returns matching lines with paths.",
        {
            "query": _text("A regular expression (Rust syntax)."),
            "file_glob": _text("Only files matching this glob, e.g. '**/*.py'."),
            "max_results": {"type": "integer", "minimum": 1, "maximum": 500},
        },
        ["query"],
    ),
    _tool(
        "run_tests",
        "Run the test suite, or some of its files, and return the runner's output.",
        {
            "paths": {"type": "array", "items": {"type": "string"}, "maxItems": 50},
            "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
        },
        [],
    ),
    _tool(
        "run_command",
        "Run a shell command in the workspace and return its exit status and output.",
        {
            "command": _text("The command line."),
            "cwd": _text("Working directory relative to the workspace root."),
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        ["command"],
    ),
]
AGENT_CALLS = [
    ("list_directory", {"path": ".", "recursive": True}),
    ("read_file", {"path": "src/calc.py"}),
    ("search_code", {"query": "def add\\(", "file_glob": "**/*.py"}),
    ("edit_file", {"path": "src/calc.py", "old_text": "x + 2", "new_text": "x + 3"}),
    ("run_tests", {"paths": ["tests/test_calc.py"]}),
    ("read_file", {"path": "tests/test_calc.py", "start_line": 1, "end_line": 40}),
    ("run_tests", {}),
]
"""The agent's tool call at each turn (the upstream answers turn n with call n)."""
HISTORY_TURNS = 6
"""Earlier turns in a long session's request: its request is the run's seventh turn."""
CHAT_ANSWER = "def f(x):\n    return x + 3\n"
CHAT_OPENING = "Write f(x) that returns x plus 3. " * 8


def tool_result(turn: int) -> str:
    """What the agent's tool returned at `turn`: a listing, a file, test output (~1.5 kB)."""
    lines = [f"{turn:02d}:{n:03d}  def helper_{n}(x):  return x * {n} + {turn}" for n in range(32)]
    return "\n".join(lines)


def agent_call(turn: int, call_id: str) -> dict[str, Any]:
    name, arguments = AGENT_CALLS[min(turn, len(AGENT_CALLS) - 1)]
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def agent_history(turns: int) -> list[dict[str, Any]]:
    """An agent run's messages after `turns` turns: each an answer's tool call and its result."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "The add function in src/calc.py is off by one; fix it."},
    ]
    for turn in range(turns):
        call = agent_call(turn, f"call-{turn}-bench")
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn)})
    return messages


def chat_history(turns: int) -> list[dict[str, Any]]:
    """A chat's messages after `turns` answers: each the upstream's answer, then a new ask."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": CHAT_OPENING}]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": CHAT_ANSWER})
        messages.append(
            {"role": "user", "content": f"Now make it work for lists too ({turn}).\n" * 20}
        )
    return messages


@dataclass(frozen=True)
class Workload:
    """What one kind of client sends: a chat or an agent turn, first of its session or late
    in a long one (a static session id and user, whose run the gateway must find)."""

    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    long: bool
    surface: str = "chat"
    """The API its client speaks (`SURFACE_PATHS`); the gateway translates it to this chat."""

    def prefixes(self) -> list[list[dict[str, Any]]]:
        """The run's earlier turns' requests, sent one after another before the load."""
        history = agent_history if self.tools else chat_history
        return [history(turn) for turn in range(HISTORY_TURNS if self.long else 0)]


WORKLOADS = {
    "chat-fresh": Workload("chat, fresh", chat_history(0), None, long=False),
    "chat-long": Workload("chat, long", chat_history(HISTORY_TURNS), None, long=True),
    "agent-fresh": Workload("agent, fresh", agent_history(0), TOOLS, long=False),
    "agent-long": Workload("agent, long", agent_history(HISTORY_TURNS), TOOLS, long=True),
    "messages-agent-fresh": Workload(
        "agent, Messages", agent_history(0), TOOLS, long=False, surface="messages"
    ),
    "responses-agent-fresh": Workload(
        "agent, Responses", agent_history(0), TOOLS, long=False, surface="responses"
    ),
}
DEFAULT_WORKLOADS = ("chat-fresh", "chat-long", "agent-fresh", "agent-long")
NAME_WIDTH = max(len(workload.name) for workload in WORKLOADS.values())
SURFACE_PATHS = {"chat": CHAT_PATH, "messages": "/v1/messages", "responses": "/v1/responses"}


def surface_request(surface: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The request a client of `surface` sends that the gateway translates into the chat body
    `chat`: a first turn (system and user text) and its tools, in the surface's shapes."""
    if surface == "chat":
        return chat
    system = "\n\n".join(m["content"] for m in chat["messages"] if m["role"] == "system")
    turns = [m for m in chat["messages"] if m["role"] != "system"]
    functions = [tool["function"] for tool in chat.get("tools") or ()]
    if surface == "messages":  # as Claude Code sends it: text blocks, x-api-key
        return {
            "model": chat["model"],
            "system": [{"type": "text", "text": system}],
            "messages": [
                {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                for m in turns
            ],
            "tools": [
                {
                    "name": f["name"],
                    "description": f["description"],
                    "input_schema": f["parameters"],
                }
                for f in functions
            ],
            "max_tokens": chat["max_tokens"],
        }
    # As Codex sends it: the whole conversation as input items, nothing stored.
    return {
        "model": chat["model"],
        "instructions": system,
        "input": [
            {
                "type": "message",
                "role": m["role"],
                "content": [{"type": "input_text", "text": m["content"]}],
            }
            for m in turns
        ],
        "tools": [{"type": "function", **f} for f in functions],
        "max_output_tokens": chat["max_tokens"],
        "store": False,
    }


# -- the fixed-latency upstream (a measuring instrument, run in its own process) -------------


def _token(position: int) -> int:
    # One id per position: each turn's prompt starts with the turn before's prompt + answer.
    return (104_729 * position) % 32_000


def _logprob_entries(count: int) -> list[dict[str, Any]]:
    return [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}] * count


def _prompt_tokens(turn: int) -> int:
    return 300 + 500 * turn


def _answer_message(turn: int, tools: bool) -> dict[str, Any]:
    if tools:
        return {"role": "assistant", "content": None, "tool_calls": [agent_call(turn, "call_b")]}
    return {"role": "assistant", "content": CHAT_ANSWER}


def fixed_completion(model: str, turn: int = 0, tools: bool = False) -> bytes:
    """A non-streaming chat completion shaped and sized like vLLM's, logprobs included: the
    run's `turn`-th answer (a tool call when tools are declared)."""
    prompt = _prompt_tokens(turn)
    tokens = [_token(prompt + n) for n in range(COMPLETION_TOKENS)]
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": _answer_message(turn, tools),
                    "logprobs": {"content": _logprob_entries(COMPLETION_TOKENS)},
                    "finish_reason": "tool_calls" if tools else "stop",
                    "token_ids": tokens,
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": COMPLETION_TOKENS},
            "prompt_token_ids": [_token(n) for n in range(prompt)],
        }
    )


def fixed_stream(model: str, chunks: int, turn: int = 0, tools: bool = False) -> list[bytes]:
    """The same completion as vLLM streams it: SSE chunks of a few tokens each, then [DONE]."""
    prompt = _prompt_tokens(turn)
    per_chunk = max(1, COMPLETION_TOKENS // chunks)
    answer = _answer_message(turn, tools)
    events = []
    for n in range(chunks):
        delta: dict[str, Any] = {"role": "assistant"} if n == 0 else {}
        if tools:
            if n == 0:
                delta["tool_calls"] = [{"index": 0, **answer["tool_calls"][0]}]
        else:
            delta["content"] = "x + 3 " if n else "def f(x): "
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": {"content": _logprob_entries(per_chunk)},
            "finish_reason": ("tool_calls" if tools else "stop") if n == chunks - 1 else None,
            "token_ids": [_token(prompt + n * per_chunk + i) for i in range(per_chunk)],
        }
        chunk: dict[str, Any] = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [choice],
        }
        if n == 0:
            chunk["prompt_token_ids"] = [_token(i) for i in range(prompt)]
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def serve_fixed_upstream(port: int, delay_ms: float, chunks: int, chunk_gap_ms: float) -> None:
    """Answer `/v1/chat/completions` after `delay_ms` (the first chunk, when streaming, then
    one chunk every `chunk_gap_ms`) with the run's next answer, the turn told by the answers
    in the request's history; `/v1/models` (both checkpoints) and `/health` at once."""
    import uvicorn

    bodies: dict[tuple[str, int, bool], bytes] = {}
    streams: dict[tuple[str, int, bool], list[bytes]] = {}
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
        if scope["path"] != CHAT_PATH:
            content = models if scope["path"] == "/v1/models" else b"{}"
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": content})
            return
        request = orjson.loads(raw)
        model = request.get("model") if request.get("model") in CHECKPOINTS else CHECKPOINTS[0]
        turn = sum(1 for m in request["messages"] if m.get("role") == "assistant")
        answer = (model, turn, bool(request.get("tools")))
        await asyncio.sleep(delay_ms / 1000)
        if not request.get("stream"):
            if answer not in bodies:
                bodies[answer] = fixed_completion(*answer)
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": bodies[answer]})
            return
        if answer not in streams:
            streams[answer] = fixed_stream(model, chunks, turn, answer[2])
        # The headers leave with the first token, as a model server's first chunk would.
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        events = streams[answer]
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
    cpu_s: float = float("nan")
    """CPU time the gateway's processes used during the phase (all threads)."""
    loop_cpu_s: float = float("nan")
    """Of which its event loops' threads (each process's main thread)."""
    own: list[tuple[float, float]] = field(default_factory=list)
    """The gateway's own time in the phase's chats (`rtrl_http_overhead_seconds`, ms): its
    histogram's cumulative counts by upper bound, counted during the phase."""

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

    def own_ms(self, q: float) -> float:
        """A quantile of the gateway's own time, interpolated within its histogram bucket."""
        if not self.own or not self.own[-1][1]:
            return float("nan")
        rank, lower, below = q * self.own[-1][1], 0.0, 0.0
        for upper, count in self.own:
            if count >= rank:
                if math.isinf(upper):
                    return lower
                return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
            lower, below = upper, count
        return lower

    def cpu_ms(self, loop: bool = False) -> float:
        """The gateway's CPU time per request answered (its event loops' alone: `loop`)."""
        spent = self.loop_cpu_s if loop else self.cpu_s
        return 1000 * spent / len(self.samples) if self.samples else float("nan")


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
    users: tuple[str, ...] = ()
    """X-User-Id of each hey process in turn; none: the header is not sent."""
    workload: str = "chat-fresh"
    path: str = CHAT_PATH


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time of process `pid` and its descendants so far: all threads, and the main
    threads (each process's event loop) alone. Linux /proc; NaN elsewhere."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    parents[int(entry)] = int(fields[1])
    except OSError:
        return float("nan"), float("nan")
    family, grew = {pid}, True
    while grew:
        found = {child for child, parent in parents.items() if parent in family}
        grew = not found <= family
        family |= found
    total = loops = 0.0
    for member in family:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{member}/task"):
                stat = Path(f"/proc/{member}/task/{task}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                spent = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                total += spent
                if int(task) == member:
                    loops += spent
    return total, loops


def hey_processes(rate: float) -> int:
    return max(2, min(40, math.ceil(rate * PERIOD_S)))


def run_hey(
    target: Target,
    *,
    stream: bool,
    rate: float,
    seconds: float,
    work: Path,
    side_load: list[list[str]] | None = None,
    measured_pid: int | None = None,
) -> Phase:
    """`rate` requests/s for `seconds` from several single-connection hey processes started
    one after the other, so their ticks interleave instead of arriving in bursts."""
    work.mkdir(parents=True, exist_ok=True)
    body_file = work / f"{target.name}-{target.workload}-{'stream' if stream else 'plain'}.json"
    body_file.write_bytes(orjson.dumps({**target.body, "stream": stream}))
    count = hey_processes(rate)
    side = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for command in side_load or []]
    cpu_before = cpu_seconds(measured_pid) if measured_pid else None
    processes = []
    for n in range(count):
        headers = [*target.headers]
        if target.users:
            headers += ["-H", f"X-User-Id: {target.users[n % len(target.users)]}"]
        command = [
            "hey",
            *("-z", f"{seconds:g}s", "-c", "1", "-q", f"{rate / count:.4f}", "-t", "10"),
            *("-m", "POST", "-T", "application/json", "-D", str(body_file), "-o", "csv"),
            *headers,
            f"{target.url}{target.path}",
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
    if cpu_before is not None and measured_pid:
        cpu_after = cpu_seconds(measured_pid)
        phase.cpu_s, phase.loop_cpu_s = (a - b for a, b in zip(cpu_after, cpu_before, strict=True))
    for side_process in side:
        side_process.wait(timeout=seconds + 60)
    return phase


def feedback_config(path: Path, gateway: str, key: str, request_ids: list[str]) -> None:
    """A curl config of one POST to /v1/feedback per request id, each a new batch of two
    events about that completion (a request takes one verdict: a second is a 409)."""
    entries = []
    for request_id in request_ids:
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


OWN_METRIC = "rtrl_http_overhead_seconds_bucket"


def scraped(gateway: str) -> list[MetricSample]:
    """Every sample of the gateway's /metrics, as prometheus_client parses them."""
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def own_buckets(gateway: str, route: str) -> dict[float, float]:
    """A route's `rtrl_http_overhead_seconds` so far: cumulative count by bound (ms)."""
    return {
        float(sample.labels["le"]) * 1000: sample.value
        for sample in scraped(gateway)
        if sample.name == OWN_METRIC and sample.labels.get("route") == route
    }


def counted(gateway: str, metric: str, label: str) -> dict[str, float]:
    """A counter of the gateway's /metrics summed by one of its labels."""
    counts: collections.defaultdict[str, float] = collections.defaultdict(float)
    for sample in scraped(gateway):
        if sample.name == metric:
            counts[sample.labels[label]] += sample.value
    return dict(counts)


# -- the bench --------------------------------------------------------------------------------


@dataclass
class Setup:
    stack: EmbeddedStack
    key: str
    root: Path
    gateway_url: str
    workloads: dict[str, tuple[Target, Target]]
    """Each workload's direct call and its call through the gateway."""
    proxy: Target
    """A bare pass-through proxy (uvicorn and aiohttp, as the gateway): the hop's own cost."""
    request_ids: list[str]
    gateway_process: subprocess.Popen[bytes] | None = None
    proxy_process: subprocess.Popen[bytes] | None = None


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


def phase_name(target: Target) -> str:
    return target.name if target.name == "proxy" else f"{target.name}/{target.workload}"


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
    latencies: list[float] = []
    errors = 0
    work = setup.root / f"round-{round_number}-{'stream' if stream else 'plain'}-{rate:g}"
    for target in order:
        side = []
        gateway = target.name == "gateway"
        measured = {"gateway": setup.gateway_process, "proxy": setup.proxy_process}.get(target.name)
        if gateway and args.feedback_rate > 0:
            config = work / "feedback.cfg"
            work.mkdir(parents=True, exist_ok=True)
            batches = int(args.feedback_rate * seconds)
            feedback_config(
                config, setup.gateway_url, setup.key, served_for_feedback(setup, batches)
            )
            side.append(feedback_command(config, args.feedback_rate, work / "feedback.out"))
        own_before = own_buckets(setup.gateway_url, target.path) if gateway else {}
        phase = phases[phase_name(target)] = run_hey(
            target,
            stream=stream,
            rate=rate,
            seconds=seconds,
            work=work,
            side_load=side,
            measured_pid=measured.pid if measured else None,
        )
        if gateway:
            own_after = own_buckets(setup.gateway_url, target.path)
            phase.own = sorted(
                (bound, count - own_before.get(bound, 0.0)) for bound, count in own_after.items()
            )
        if side:
            more, failed = read_feedback(work / "feedback.out")
            latencies += more
            errors += failed
    return phases, latencies, errors


def added(direct: Phase, gateway: Phase, q: float, first_byte: bool = False) -> float:
    return gateway.quantile(q, first_byte) - direct.quantile(q, first_byte)


@dataclass
class Added:
    """What the gateway adds to one workload in one mode: the median over rounds."""

    p50: float
    p99: float
    cpu_ms: float
    loop_cpu_ms: float
    own_p50: float = float("nan")
    """The gateway's own time to the first byte (`rtrl_http_overhead_seconds`), ms."""
    own_p99: float = float("nan")


def print_rounds(
    title: str,
    rounds: list[dict[str, Phase]],
    workloads: list[str],
    *,
    first_byte: bool = False,
    own: bool = True,
) -> dict[str, Added]:
    """Per workload and round: the direct call, what the gateway adds to it and (`own`) its
    own time to the first byte; then what the bare proxy adds to the plain chat's."""
    print(f"\n{title}")
    print(
        f"  {'workload':<{NAME_WIDTH}} {'round':>5} {'direct p50':>10} {'p99':>6} │"
        f" {'gateway p50':>11} {'p99':>6} {'+p50':>6} {'+p99':>6} │ {'req/s':>6} {'errors':>6}"
        f" │ {'CPU ms/req':>10} {'loop':>5}" + (f" │ {'own p50':>7} {'p99':>5}" if own else "")
    )
    medians: dict[str, Added] = {}
    for workload in workloads:
        added50, added99, cpu, loop, own50, own99 = [], [], [], [], [], []
        for n, phases in enumerate(rounds, start=1):
            direct, gateway = phases[f"direct/{workload}"], phases[f"gateway/{workload}"]
            a50 = added(direct, gateway, 0.5, first_byte)
            a99 = added(direct, gateway, 0.99, first_byte)
            added50.append(a50)
            added99.append(a99)
            cpu.append(gateway.cpu_ms())
            loop.append(gateway.cpu_ms(loop=True))
            own50.append(gateway.own_ms(0.5))
            own99.append(gateway.own_ms(0.99))
            print(
                f"  {WORKLOADS[workload].name:<{NAME_WIDTH}} {n:>5}"
                f" {direct.quantile(0.5, first_byte):>10.1f}"
                f" {direct.quantile(0.99, first_byte):>6.1f} │"
                f" {gateway.quantile(0.5, first_byte):>11.1f}"
                f" {gateway.quantile(0.99, first_byte):>6.1f} {a50:>6.1f} {a99:>6.1f} │"
                f" {gateway.achieved:>6.1f} {direct.errors + gateway.errors:>6} │"
                f" {cpu[-1]:>10.2f} {loop[-1]:>5.2f}"
                + (f" │ {own50[-1]:>7.2f} {own99[-1]:>5.2f}" if own else "")
            )
        medians[workload] = Added(
            statistics.median(added50),
            statistics.median(added99),
            statistics.median(cpu),
            statistics.median(loop),
            statistics.median(own50),
            statistics.median(own99),
        )
    if all("proxy" in phases for phases in rounds):
        first = workloads[0]
        proxy50 = [added(r[f"direct/{first}"], r["proxy"], 0.5, first_byte) for r in rounds]
        proxy99 = [added(r[f"direct/{first}"], r["proxy"], 0.99, first_byte) for r in rounds]
        proxy_cpu = statistics.median(r["proxy"].cpu_ms() for r in rounds)
        medians["proxy"] = Added(
            statistics.median(proxy50), statistics.median(proxy99), proxy_cpu, proxy_cpu
        )
        print(
            f"  bare proxy ({WORKLOADS[first].name}), each round: "
            + ", ".join(f"+{a:.1f} / +{b:.1f}" for a, b in zip(proxy50, proxy99, strict=True))
            + f"; its CPU {proxy_cpu:.2f} ms/req"
        )
    return medians


def print_side_by_side(
    modes: list[tuple[str, dict[str, Added]]], workloads: list[str], args: Any
) -> None:
    """Every workload and mode in one table: the medians of what the gateway adds."""
    print(
        f"\nadded by the gateway over the direct call at {args.rate:g} req/s, median of "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''} (ms, p50 / p99; budget "
        f"{args.p50_budget_ms:g} / {args.p99_budget_ms:g}); its CPU per request (ms, all threads)"
    )
    print(
        f"  {'':<{NAME_WIDTH}}"
        + "".join(f" │ {title:^13}" for title, _ in modes)
        + f" │ {'CPU ms/req':>10}"
    )
    over = []
    for workload in [*workloads, "proxy"]:
        if workload not in modes[0][1]:
            continue
        name = WORKLOADS[workload].name if workload in WORKLOADS else "bare proxy"
        cells = []
        for title, medians in modes:
            result = medians[workload]
            cells.append(f" │ {result.p50:>5.1f} / {result.p99:<5.1f}")
            if workload != "proxy" and (
                result.p50 > args.p50_budget_ms or result.p99 > args.p99_budget_ms
            ):
                over.append(f"{name} ({title})")
        cpu = modes[0][1][workload].cpu_ms
        print(f"  {name:<{NAME_WIDTH}}" + "".join(cells) + f" │ {cpu:>10.2f}")
    print(
        "  within budget: "
        + ("all" if not over else "no: " + ", ".join(over))
        + f"; load average {os.getloadavg()[0]:.1f}"
    )
    owned = [(title, medians) for title, medians in modes if title != "stream total"]
    print(
        "\nof which the gateway's own time, to the first byte less vLLM's wait "
        "(rtrl_http_overhead_seconds; ms, p50 / p99); the rest is the hop and the machine"
    )
    print(f"  {'':<{NAME_WIDTH}}" + "".join(f" │ {title:^13}" for title, _ in owned))
    for workload in workloads:
        cells = [
            f" │ {medians[workload].own_p50:>5.2f} / {medians[workload].own_p99:<5.2f}"
            for _, medians in owned
        ]
        print(f"  {WORKLOADS[workload].name:<{NAME_WIDTH}}" + "".join(cells))


def sweep(setup: Setup, rates: list[float], args: Any) -> list[tuple[float, Phase, Phase]]:
    direct, gateway = setup.workloads["chat-fresh"]
    results = []
    for n, rate in enumerate(rates):
        phases, _, _ = interleaved(
            setup,
            [direct, gateway],
            stream=False,
            rate=rate,
            seconds=args.sweep_seconds,
            round_number=100 + n,
            args=args,
        )
        results.append((rate, phases["direct/chat-fresh"], phases["gateway/chat-fresh"]))
    return results


def profile(setup: Setup, workloads: list[str], args: Any) -> None:
    """py-spy on the gateway through a non-streaming and a streaming phase of each workload;
    top frames."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("\nprofile: skipped (pip install py-spy, or the dev extra)")
        return
    assert setup.gateway_process is not None
    pid = setup.gateway_process.pid
    for workload in workloads:
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            raw = setup.root / f"profile-{workload}-{mode}.txt"
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
                    "--gil",
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
                setup.workloads[workload][1],
                stream=stream,
                rate=args.rate,
                seconds=args.seconds - 2,
                work=setup.root / "profile",
            )
            spy.wait(timeout=args.seconds + 60)
            print(
                f"\nprofile of the gateway, {WORKLOADS[workload].name}, "
                f"{'streaming' if stream else 'non-streaming'} at {args.rate:g} req/s "
                f"(py-spy, {raw})"
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


def setup_load(stack: EmbeddedStack, key: str, root: Path, workloads: list[str]) -> Setup:
    upstream = f"http://127.0.0.1:{free_port()}"
    gateway = f"http://127.0.0.1:{free_port()}"
    targets = {}
    for name in workloads:
        workload = WORKLOADS[name]
        body: dict[str, Any] = {"messages": workload.messages, "max_tokens": COMPLETION_TOKENS}
        if workload.tools:
            body["tools"] = workload.tools
        direct_body = body | {
            # The gateway always asks vLLM for logprobs and token ids; so does the direct call.
            "model": CHECKPOINTS[0],
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
        }
        headers: tuple[str, ...] = ("-H", f"Authorization: Bearer {key}")
        if workload.surface == "messages":
            headers = ("-H", f"x-api-key: {key}", "-H", "anthropic-version: 2023-06-01")
        if workload.long:
            # As an IDE that names its session: one id, one user, a run with history.
            headers += ("-H", f"X-Session-Id: bench-{name}")
        # Another surface's direct call is the chat body the gateway translates it into.
        targets[name] = (
            Target("direct", upstream, (), direct_body, workload=name),
            Target(
                "gateway",
                gateway,
                headers,
                surface_request(workload.surface, body | {"model": "rtrl"}),
                workload=name,
                path=SURFACE_PATHS[workload.surface],
            ),
        )
    direct_chat = targets[workloads[0]][0]
    return Setup(
        stack=stack,
        key=key,
        root=root,
        gateway_url=gateway,
        workloads=targets,
        proxy=Target("proxy", f"http://127.0.0.1:{free_port()}", (), direct_chat.body),
        request_ids=[],
    )


def seed_runs(setup: Setup) -> list[str]:
    """The users of each arm, found by serving each one a chat (completions the feedback is
    then about; warms the caches too), and the earlier turns of every long session's run,
    sent one after the other as its client would, so that its requests continue a run."""
    arms: dict[str, list[str]] = collections.defaultdict(list)
    headers = {"Authorization": f"Bearer {setup.key}"}
    chat = {"model": "rtrl", "messages": chat_history(0), "max_tokens": COMPLETION_TOKENS}
    for n in range(64):
        request_id, user = f"bench-{uuid.uuid4().hex[:12]}", f"bench-user-{n}"
        checkpoint = post(
            f"{setup.gateway_url}/v1/chat/completions",
            chat,
            headers | {"X-Request-Id": request_id, "X-User-Id": user, "X-Session-Id": SESSION_ID},
        )
        arms[checkpoint].append(user)
        setup.request_ids.append(request_id)
    users = [user for pair in zip(*arms.values(), strict=False) for user in pair]
    if len(arms) != len(CHECKPOINTS):
        print(f"warning: 64 users all went to {', '.join(arms)}", flush=True)
        users = [user for members in arms.values() for user in members]
    one_per_arm = tuple(members[0] for members in arms.values())
    for name, (direct, gateway) in setup.workloads.items():
        workload = WORKLOADS[name]
        gateway = dataclasses.replace(gateway, users=one_per_arm if workload.long else tuple(users))
        setup.workloads[name] = (direct, gateway)
        for user in gateway.users if workload.long else ():
            session = {"X-Session-Id": f"bench-{name}", "X-User-Id": user}
            for messages in workload.prefixes():
                body = gateway.body | {"messages": messages}
                post(f"{setup.gateway_url}/v1/chat/completions", body, headers | session)
    return users


def served_for_feedback(setup: Setup, count: int) -> list[str]:
    """`count` request ids of completions no feedback was sent about: the seeded ones first,
    then new chats served through the gateway (before the phase's clock starts)."""
    fresh = setup.request_ids[:count]
    del setup.request_ids[:count]
    headers = {"Authorization": f"Bearer {setup.key}", "X-Session-Id": SESSION_ID}
    chat = {"model": "rtrl", "messages": chat_history(0), "max_tokens": COMPLETION_TOKENS}

    def serve(n: int) -> str:
        request_id = f"bench-{uuid.uuid4().hex[:12]}"
        user = {"X-User-Id": f"bench-user-{n % 64}", "X-Request-Id": request_id}
        post(f"{setup.gateway_url}/v1/chat/completions", chat, headers | user)
        return request_id

    with ThreadPoolExecutor(max_workers=8) as pool:
        fresh += pool.map(serve, range(count - len(fresh)))
    return fresh


def check_served(setup: Setup) -> None:
    """Each workload's request through the gateway, whole and streamed, once: a refusal would
    leave the load timing errors, so any status but 200 ends the bench with the answer."""
    for name, (_, gateway) in setup.workloads.items():
        headers = dict(header.split(": ", 1) for header in gateway.headers[1::2])
        headers["Content-Type"] = "application/json"
        if gateway.users:
            headers["X-User-Id"] = gateway.users[0]
        for stream in (False, True):
            request = urllib.request.Request(
                f"{setup.gateway_url}{gateway.path}",
                data=orjson.dumps(gateway.body | {"stream": stream}),
                headers=headers,
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
            except urllib.error.HTTPError as refused:
                answer = refused.read()[:2000].decode(errors="replace")
                sys.exit(
                    f"error: {gateway.path} answered {name}'s request"
                    f"{' (streamed)' if stream else ''} with {refused.code}: {answer}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s (default 100)")
    parser.add_argument("--seconds", type=float, default=15.0, help="per phase (default 15)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, the first measured beside the bare proxy ({', '.join(WORKLOADS)})",
    )
    parser.add_argument("--delay-ms", type=float, default=20.0, help="upstream time to answer")
    parser.add_argument("--stream-chunks", type=int, default=20)
    parser.add_argument("--chunk-gap-ms", type=float, default=1.0)
    parser.add_argument("--feedback-rate", type=float, default=10.0, help="batches/s")
    parser.add_argument("--sweep", default="100,200,300,400,500", help="rates; empty: none")
    parser.add_argument("--sweep-seconds", type=float, default=10.0)
    parser.add_argument("--p50-budget-ms", type=float, default=2.0)
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
    workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in workloads if name not in WORKLOADS]
    if unknown or not workloads:
        parser.error(f"--workloads: choose among {', '.join(WORKLOADS)} (not {unknown})")
    if args.rate <= 0 or args.seconds < 5 or args.rounds < 1 or any(r <= 0 for r in rates):
        parser.error("--rate and --sweep rates must be positive, --seconds at least 5")
    ensure_tools()

    root = Path(tempfile.mkdtemp(prefix="rtrl-bench-gateway-"))
    print(
        f"working in {root}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    stack = scratch_stack(root)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        stack.up()
        key = prepare_registry(stack)
        setup = setup_load(stack, key, root, workloads)
        upstream = setup.workloads[workloads[0]][0].url
        upstream_port = int(upstream.rsplit(":", 1)[1])
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
        setup.proxy_process = start_process(
            [
                *(sys.executable, "-m", "bench.gateway", "--serve-proxy", str(proxy_port)),
                *("--proxy-upstream", upstream),
            ],
            {"PYTHONPATH": str(ROOT)},
            root / "proxy.log",
        )
        processes.append(setup.proxy_process)
        wait_for_port("127.0.0.1", proxy_port, timeout=30, name="proxy")
        gateway_port = int(setup.gateway_url.rsplit(":", 1)[1])
        setup.gateway_process = start_gateway(
            stack, upstream, root / "gateway", gateway_port, args.gateway_workers
        )
        processes.append(setup.gateway_process)
        seed_runs(setup)
        check_served(setup)
        for name in workloads:  # the gateway's first seconds: connections, imports, caches
            for stream in (False, True):
                run_hey(
                    setup.workloads[name][1],
                    stream=stream,
                    rate=args.rate,
                    seconds=5 if name == workloads[0] else 2,
                    work=root / "warm-up",
                )
        report(setup, workloads, rates, args)
    finally:
        for process in reversed(processes):
            stop(process)
        stack.down()
    print(f"\nlogs in {root}; load average now {os.getloadavg()[0]:.1f}")


def report(setup: Setup, workloads: list[str], rates: list[float], args: Any) -> None:
    print(
        f"\nfixed {args.delay_ms:g} ms upstream, {COMPLETION_TOKENS} completion tokens with "
        f"logprobs (streamed in {args.stream_chunks} chunks, {args.chunk_gap_ms:g} ms apart); "
        f"{args.rate:g} req/s from {hey_processes(args.rate)} hey processes for "
        f"{args.seconds:g} s a phase; feedback {args.feedback_rate:g} batches/s (curl) during "
        f"the gateway's phases; gateway workers: {args.gateway_workers}",
        flush=True,
    )
    for name in workloads:
        workload = WORKLOADS[name]
        sent = setup.workloads[name][1]
        print(
            f"  {workload.name}: {sent.path}, {len(workload.messages)} messages, "
            f"{len(workload.tools or ())} tools, {len(orjson.dumps(sent.body)) / 1024:.1f} kB; "
            + (
                f"one session id and user per arm, the run's turn {HISTORY_TURNS + 1}"
                if workload.long
                else f"no session id, {len(sent.users)} users, a run's first turn"
            )
        )
    targets = [target for name in workloads for target in setup.workloads[name]]
    targets.insert(1, setup.proxy)
    plain: list[dict[str, Phase]] = []
    streamed: list[dict[str, Phase]] = []
    feedback: list[float] = []
    feedback_errors = 0
    for n in range(args.rounds):
        for stream, rounds in ((False, plain), (True, streamed)):
            phases, latencies, errors = interleaved(
                setup,
                targets,
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
    modes = [
        (
            "non-streaming",
            print_rounds(f"non-streaming, {args.rate:g} req/s: total time (ms)", plain, workloads),
        ),
        (
            "first byte",
            print_rounds(
                f"streaming, {args.rate:g} req/s: time to first byte (ms)",
                streamed,
                workloads,
                first_byte=True,
            ),
        ),
        (
            "stream total",
            print_rounds(
                f"streaming, {args.rate:g} req/s: total time (ms)", streamed, workloads, own=False
            ),
        ),
    ]
    print(
        f"\nfeedback (curl, {args.feedback_rate:g} batches/s of 2 events): {len(feedback)} "
        f"accepted, {feedback_errors} errors, p50 {quantile(feedback, 0.5):.1f} ms, "
        f"p99 {quantile(feedback, 0.99):.1f} ms"
    )
    served = counted(setup.gateway_url, "rtrl_completions_total", "checkpoint")
    print(
        "completions by checkpoint (50/50 experiment): "
        + ", ".join(f"{name} {count:.0f}" for name, count in sorted(served.items()))
    )
    links = counted(setup.gateway_url, "rtrl_trajectory_links_total", "outcome")
    print(
        "run lookups (a long session's turn continues its run, its tokens a prefix): "
        + ", ".join(f"{name} {count:.0f}" for name, count in sorted(links.items()))
    )
    print_side_by_side(modes, workloads, args)
    if rates and "chat-fresh" in workloads:
        print(f"\nsweep, chat, fresh, non-streaming, {args.sweep_seconds:g} s a phase (ms)")
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
        profile(setup, workloads, args)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
