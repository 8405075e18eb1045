"""Hostile input against a running stack: how long each attack holds the gateway's event loop,
how its cost grows with its size, and whether the workers still drain behind it.

Starts its own stack (Postgres, Kafka, Redis, vLLM, a gateway, one worker) in a scratch data
directory on free ports. A thread sends `GET /healthz` every 10 ms for the whole run; each
hostile request is timed against it: the slowest probe in flight at any moment between the
request's start and 100 ms after its answer (where work it left behind would show). Each
hostile request's own time, from its start to its answer, is kept too (a case's slowest per
repeat, the median of those in the table); a feedback post waits on no model, so its time is
the gateway's. After each case's repeats, the gateway's spool and then the workers' consumer
group are waited on for up to 30 s; the lag is what the group has left uncommitted on the
completions and feedback topics, plus what the spool still holds if it never emptied. The
baseline, first, is an ordinary small completion measured the same way in the same run, after
one unmeasured warm-up completion that the worker has stored.

Cases (the "hostile input" table of docs/operators/reliability.md has the answers):
  history         2,000 empty assistant answers between 2,001 user turns
  private         a privacy-mode completion, then a follow-up of 8,000 newlines (classified at
                  the gateway)
  answer          a completion, then a follow-up of 16,000 characters: an unclosed code fence
                  and blank lines (the worker classifies it)
  followup4k      a privacy-mode completion, then a follow-up of 4,000 characters of
                  stack-frame-like lines (`" at " + letters`), classified at the gateway
  followup16k     the same at 16,000 characters (the most a follow-up may carry): its time is
                  set beside followup4k's
  schema          a tool schema nested 300 levels deep (`items` in `items`)
  pattern         a tool whose argument must match `^(\\w+\\s?)*$` (catastrophic backtracking in
                  Python's `re`), named in `tool_choice` so the model writes a call
  schemas         six wide tool schemas never seen before, together 2 values under the
                  20,000 one request may bring (`MAX_REQUEST_SCHEMA_NODES`), the body near
                  `RTRL_MAX_REQUEST_BYTES`
  shapes          `"tool_calls": 5` in an answer; `"tool_call_id": []` in a tool message
  feedback-flood  a completion, then as many `edit_survival` events on it as an API key may
                  send (`RTRL_FEEDBACK_SURVIVAL_REPORTS_PER_REQUEST`), then 1,000 more in
                  batches of 100
  continue-quote  a Continue `chatFeedback` event quoting an answer of code lines that fills
                  the body to within a line of `RTRL_MAX_REQUEST_BYTES`
  continue-fences the same, the answer distinct three-line fenced blocks (the code of the
                  first 64 is looked up as well as the whole text)
  login           `POST /dashboard/login` with six form fields
  size            a body one byte under `RTRL_MAX_REQUEST_BYTES`, and one byte over it

Targets: every answer as the table says, the worst probe under 100 ms, lag 0, and a case sent
at 4 times the size of another (followup16k of followup4k) taking at most 4 times its time
(linear or better). Exit 0 when every case meets them, 1 otherwise. Everything it started is
stopped on the way out, after a failure, Ctrl-C or SIGTERM too.

    python -m bench.hostile [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import string
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, count, groupby
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import orjson
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from app.auth.service import new_api_key
from app.config import Settings
from app.db import make_engine, session_scope
from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC
from app.gateway.schemas import MAX_REQUEST_SCHEMA_NODES
from app.kafka.admin import DEFAULT_TOPICS
from app.kafka.clients import kafka_client
from app.models import Role
from bench._stack import scratch_settings
from rtrl.launcher import FullStack

# `WorkerConfig.group_id`, the group `rtrl worker` joins. Not imported: run as a file, this
# directory comes first on sys.path and `workers` is bench/workers.py.
WORKER_GROUP = "rtrl-workers"
WORST_MS_TARGET = 100.0
PROBE_INTERVAL_S = 0.01
AFTER_ANSWER_S = 0.1
DRAIN_TIMEOUT_S = 30.0
PROMPT = [{"role": "user", "content": "Write f(x) that returns x plus 3."}]
GROWTH = 4
"""How many times the larger case of a pair sends; linear cost takes at most as many times
as long."""
WIDE_TOOLS = 6
FLOOD_EVENTS = 1000
FLOOD_BATCH = 100


@dataclass(frozen=True)
class Probe:
    sent: float
    latency_s: float


class HealthWatch:
    """`GET /healthz` every 10 ms from a thread of its own; every probe's latency kept."""

    def __init__(self, gateway_url: str) -> None:
        self.url = f"{gateway_url}/healthz"
        self.probes: list[Probe] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                # A probe that fails counts for as long as it took.
                with contextlib.suppress(httpx.HTTPError):
                    client.get(self.url)
                self.probes.append(Probe(sent, time.monotonic() - sent))
                self._stop.wait(max(0.0, sent + PROBE_INTERVAL_S - time.monotonic()))

    def worst_ms(self, start: float, end: float) -> float:
        """The slowest probe in flight at any moment of [start, end]; waits for the one in
        flight at `end` to come back."""
        deadline = time.monotonic() + 65
        while not (self.probes and self.probes[-1].sent > end) and time.monotonic() < deadline:
            time.sleep(0.005)
        overlapping = []
        # One probe at a time: going back from the newest, the first that ended before
        # `start` is the last that can matter.
        for probe in reversed(self.probes):
            if probe.sent + probe.latency_s < start:
                break
            if probe.sent <= end:
                overlapping.append(probe.latency_s)
        return max(overlapping, default=float("nan")) * 1000


class Gateway:
    """The gateway under attack with an IDE key; `hostile` times a request against /healthz."""

    def __init__(self, url: str, key: str, watch: HealthWatch) -> None:
        self.url = url
        self.key = key
        self.watch = watch
        self.http = httpx.Client(base_url=url, timeout=180)
        self.json_headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.worst: list[float] = []
        self.answer_s: list[float] = []
        """Each hostile request's time from its start to its answer."""
        self.refusals: list[str] = []
        """`status code` (or type) of each hostile request refused in the OpenAI error shape."""
        self.feedback_sent = 0
        self.feedback_taken = 0
        """Feedback events posted, and those the gateway's 202 answers say it accepted."""

    def chat(
        self, body: bytes, *, privacy: bool = False, hostile: bool = True
    ) -> tuple[httpx.Response, str, str]:
        """A completion in a session of its own: the response, its session and request id."""
        session_id, request_id = f"hostile-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
        headers = {
            "Authorization": f"Bearer {self.key}",
            "Content-Type": "application/json",
            "X-Session-Id": session_id,
            "X-Request-Id": request_id,
        }
        if privacy:
            headers["X-Rtrl-Privacy"] = "1"

        def send() -> httpx.Response:
            return self.http.post("/v1/chat/completions", content=body, headers=headers)

        return (self.hostile(send) if hostile else send()), session_id, request_id

    def followup(self, session_id: str, request_id: str, message: str) -> httpx.Response:
        followup = {
            "kind": "followup_message",
            "session_id": session_id,
            "request_id": request_id,
            "message": message,
        }
        return self.feedback([followup])

    def feedback(self, events: list[dict[str, Any]]) -> httpx.Response:
        """One `POST /v1/feedback` batch, timed; the events it carried and those taken counted."""
        batch = orjson.dumps({"events": events})
        response = self.hostile(
            lambda: self.http.post("/v1/feedback", content=batch, headers=self.json_headers)
        )
        self.feedback_sent += len(events)
        if response.status_code == 202:
            self.feedback_taken += response.json()["accepted"]
        return response

    def continue_event(self, body: bytes) -> httpx.Response:
        """One event of Continue's data destination, timed."""
        return self.hostile(
            lambda: self.http.post("/v1/adapters/continue", content=body, headers=self.json_headers)
        )

    def hostile(self, send: Callable[[], httpx.Response]) -> httpx.Response:
        started = time.monotonic()
        response = send()
        answered = time.monotonic()
        self.answer_s.append(answered - started)
        time.sleep(AFTER_ANSWER_S)
        self.worst.append(self.watch.worst_ms(started, answered + AFTER_ANSWER_S))
        if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
            error = response.json()["error"]
            self.refusals.append(f"{response.status_code} {error['code'] or error['type']}")
        return response

    def close(self) -> None:
        self.http.close()

    def spooled(self) -> int:
        """Events the gateway has not handed to Kafka yet."""
        depth: dict[str, int] = self.http.get("/readyz").json()["spooled_events"]
        return sum(depth.values())


class GroupLag:
    """Messages on the completions and feedback topics the workers' group has not committed."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.admin = kafka_client(
            KafkaAdminClient, bootstrap_servers=bootstrap_servers, client_id="bench-hostile"
        )
        self.partitions = [
            TopicPartition(topic, partition)
            for topic in (COMPLETIONS_TOPIC, FEEDBACK_TOPIC)
            for partition in range(DEFAULT_TOPICS[topic])
        ]

        # The ends are read from the records: the embedded broker (tansu 0.6) answers a
        # ListOffsets for the latest offset with the last batch's first offset + 1, short by
        # the rest of a batch of several records; its fetches carry the true high watermark.
        self.reader = kafka_client(
            KafkaConsumer,
            bootstrap_servers=bootstrap_servers,
            client_id="bench-hostile-ends",
            enable_auto_commit=False,
            fetch_max_wait_ms=20,
        )
        self.reader.assign(self.partitions)
        self.reader.seek_to_beginning()

    def ends(self) -> dict[TopicPartition, int]:
        """Each partition's end: the offset after its last record, read until a poll finds
        none (it waits 250 ms, a dozen fetches of at most 20 ms each)."""
        while self.reader.poll(timeout_ms=250):
            pass
        return {tp: self.reader.position(tp) for tp in self.partitions}

    def lag(self) -> int:
        committed = self.admin.list_group_offsets({WORKER_GROUP: self.partitions})[WORKER_GROUP]
        behind = 0
        for tp, end in self.ends().items():
            position = committed[tp].offset if tp in committed else -1
            behind += max(0, end - max(position, 0))
        return behind

    def close(self) -> None:
        self.reader.close()
        self.admin.close()


def drained_lag(gateway: Gateway, group: GroupLag) -> int:
    """The group's lag once the gateway's spool is empty and the lag is 0; when 30 s ran out
    first, the lag then plus what the spool still holds (events no worker can have read)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        spooled = gateway.spooled()
        lag = group.lag()
        if (spooled == 0 and lag == 0) or time.monotonic() > deadline:
            return spooled + lag
        time.sleep(0.25)


def chat_body(messages: list[Any], **fields: Any) -> bytes:
    # json, not orjson: orjson refuses to nest deeper than 255 levels.
    return json.dumps({"model": "rtrl", "messages": messages, "max_tokens": 8} | fields).encode()


def nested_items(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return {"type": "object", "properties": {"path": schema}}


def sized_body(size: int) -> bytes:
    """A one-message chat body of exactly `size` bytes."""
    empty = chat_body([{"role": "user", "content": ""}])
    return chat_body([{"role": "user", "content": "x" * (size - len(empty))}])


def stack_frames(size: int) -> str:
    """`size` characters of lines shaped like a stack trace's frames (`" at "` and letters)."""
    line = " at " + string.ascii_letters + "\n"
    return (line * (size // len(line) + 1))[:size]


def wide_schema(values: int, salt: str) -> dict[str, Any]:
    """An object of string properties, each described: `values` values in all, or 1 or 2
    fewer (`salt` in every description makes the schema one no gateway has seen)."""
    properties = {
        f"field_{index}": {
            "type": "string",
            "description": f"{salt}: field {index} of the form, as the user typed it in.",
        }
        for index in range((values - 3) // 3)
    }
    return {"type": "object", "properties": properties}


def survival_reports(session_id: str, request_id: str, reports: int) -> list[dict[str, Any]]:
    """`reports` `edit_survival` events on one request, each with an id of its own."""
    return [
        {
            "event_id": str(uuid.uuid4()),
            "kind": "edit_survival",
            "session_id": session_id,
            "request_id": request_id,
            "elapsed_s": 30.0 * (index + 1),
            "surviving_share": 1.0,
        }
        for index in range(reports)
    ]


def continue_feedback(completion: str) -> bytes:
    """Continue's thumbs-down on the answer it quotes as `completion`."""
    data = {
        "eventName": "chatFeedback",
        "schema": "0.2.0",
        "feedback": False,
        "prompt": PROMPT[0]["content"],
        "completion": completion,
        "sessionId": "hostile",
        "modelTitle": "rtrl",
    }
    return orjson.dumps({"name": "chatFeedback", "data": data, "schema": "0.2.0", "level": "all"})


def quoting(lines: Iterator[str], size: int) -> bytes:
    """A `continue_feedback` body of at most `size` bytes quoting as many of `lines` (ASCII,
    nothing JSON escapes) as fit."""
    room = size - len(continue_feedback(""))
    quoted = []
    for line in lines:
        room -= len(line) + 2  # its newline is escaped as two bytes
        if room < 0:
            break
        quoted.append(line + "\n")
    return continue_feedback("".join(quoted))


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    expected: tuple[str, ...]
    """Each request's answer, in order: a status, or several separated by `/` (`4xx`: any)."""
    attack: Callable[[Gateway], list[int]]
    """Sends the case's requests (the hostile ones timed); returns their statuses."""
    scaled_from: str | None = None
    """The case this one sends `GROWTH` times as much of: its time is set beside that one's."""


def cases(settings: Settings, repeats: int) -> list[Case]:
    """The baseline first, then every hostile case, their bodies built before any is timed."""
    max_request_bytes = settings.max_request_bytes
    ordinary = chat_body(PROMPT)
    history: list[dict[str, str]] = [{"role": "user", "content": "go on"}]
    for _ in range(2000):
        history += [{"role": "assistant", "content": ""}, {"role": "user", "content": "go on"}]
    long_history = chat_body(history)
    fence = "```python\n"
    answer_like = fence + "\n" * (16_000 - len(fence))
    tool = {"type": "function", "function": {"name": "read", "parameters": nested_items(300)}}
    deep_schema = chat_body(PROMPT, tools=[tool])
    tool_calls_5 = chat_body([*PROMPT, {"role": "assistant", "content": "", "tool_calls": 5}])
    tool_call_id_list = chat_body([*PROMPT, {"role": "tool", "content": "ok", "tool_call_id": []}])
    under, over = sized_body(max_request_bytes - 1), sized_body(max_request_bytes + 1)
    six_fields = b"key=rtrl_nothing&a=1&b=2&c=3&d=4&e=5"
    searched = {
        "type": "object",
        "properties": {"q": {"type": "string", "pattern": r"^(\w+\s?)*$"}},
        "required": ["q"],
    }
    search = {"type": "function", "function": {"name": "search", "parameters": searched}}
    pattern = chat_body(
        [{"role": "user", "content": "Search the code for where f(x) is defined, and why!!"}],
        tools=[search],
        tool_choice={"type": "function", "function": {"name": "search"}},
        # Room to close the call's arguments, so that they are checked against the schema.
        max_tokens=160,
    )
    # A repeat's schemas are new to the gateway: it keeps the verdicts on those it has seen.
    per_tool = MAX_REQUEST_SCHEMA_NODES // WIDE_TOOLS
    wide_bodies = [
        chat_body(
            PROMPT,
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": f"fill_form_{index}",
                        "parameters": wide_schema(per_tool, f"repeat {repeat} {uuid.uuid4()}"),
                    },
                }
                for index in range(WIDE_TOOLS)
            ],
        )
        for repeat in range(repeats)
    ]
    wide_schemas = iter(wide_bodies)
    survival_limit = settings.feedback_survival_reports_per_request
    code_lines = quoting(
        (f"    total += values[{i}] * {i}" for i in count()), max_request_bytes - 1
    )
    fenced_blocks = quoting(
        chain.from_iterable(("```", f"x = {i}", "```") for i in count()), max_request_bytes - 1
    )

    def baseline(gateway: Gateway) -> list[int]:
        return [gateway.chat(ordinary)[0].status_code]

    def followup_case(message: str, privacy: bool) -> Callable[[Gateway], list[int]]:
        def attack(gateway: Gateway) -> list[int]:
            answer, session_id, request_id = gateway.chat(ordinary, privacy=privacy, hostile=False)
            feedback = gateway.followup(session_id, request_id, message)
            return [answer.status_code, feedback.status_code]

        return attack

    def feedback_flood(gateway: Gateway) -> list[int]:
        answer, session_id, request_id = gateway.chat(ordinary, hostile=False)
        statuses = [answer.status_code]
        for reports in (survival_limit, *[FLOOD_BATCH] * (FLOOD_EVENTS // FLOOD_BATCH)):
            batch = survival_reports(session_id, request_id, reports)
            statuses.append(gateway.feedback(batch).status_code)
        return statuses

    def login(gateway: Gateway) -> list[int]:
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        response = gateway.hostile(
            lambda: gateway.http.post("/dashboard/login", content=six_fields, headers=headers)
        )
        return [response.status_code]

    def chats(*bodies: bytes) -> Callable[[Gateway], list[int]]:
        return lambda gateway: [gateway.chat(body)[0].status_code for body in bodies]

    return [
        Case("baseline", "an ordinary completion, 8 tokens", ("200",), baseline),
        # 200 where the model's context holds the history; vLLM's 400, passed on, where it
        # does not (the shipped base's is 1,024 tokens). The same for the body a byte under.
        Case("history", "2,000 empty answers, 4,001 messages", ("200/400",), chats(long_history)),
        Case(
            "private",
            "private follow-up, 8,000 newlines",
            ("200", "202"),
            followup_case("\n" * 8000, privacy=True),
        ),
        Case(
            "answer",
            "follow-up, open fence + 15,990 newlines",
            ("200", "202"),
            followup_case(answer_like, privacy=False),
        ),
        Case(
            "followup4k",
            "private follow-up, 4,000 chars of ' at ' frames",
            ("200", "202"),
            followup_case(stack_frames(4000), privacy=True),
        ),
        Case(
            "followup16k",
            "private follow-up, 16,000 chars of ' at ' frames",
            ("200", "202"),
            followup_case(stack_frames(16_000), privacy=True),
            scaled_from="followup4k",
        ),
        Case("schema", "tool schema 300 levels deep", ("400",), chats(deep_schema)),
        # 200 whatever the model wrote (its call is checked without the pattern); a 400 of
        # vLLM's, passed on, where it cannot compile the pattern for its guided decoding.
        Case("pattern", "named tool, pattern ^(\\w+\\s?)*$", ("200/4xx",), chats(pattern)),
        # The schemas are checked before vLLM is asked, which then refuses a prompt this long.
        Case(
            "schemas",
            f"{WIDE_TOOLS} new schemas, {per_tool * WIDE_TOOLS:,} values, "
            f"{len(wide_bodies[0]):,} B",
            ("200/400",),
            lambda gateway: [gateway.chat(next(wide_schemas))[0].status_code],
        ),
        Case(
            "shapes",
            "tool_calls 5; tool_call_id []",
            ("400", "400"),
            chats(tool_calls_5, tool_call_id_list),
        ),
        Case(
            "feedback-flood",
            f"{survival_limit} + {FLOOD_EVENTS:,} edit_survival on one request",
            ("200", "202", *["409"] * (FLOOD_EVENTS // FLOOD_BATCH)),
            feedback_flood,
        ),
        # Unjoinable (no served answer of this key has that text), which is still a 202.
        Case(
            "continue-quote",
            f"Continue thumbs-down quoting {len(code_lines):,} B",
            ("202",),
            lambda gateway: [gateway.continue_event(code_lines).status_code],
        ),
        Case(
            "continue-fences",
            f"the same, {len(fenced_blocks):,} B of fenced blocks",
            ("202",),
            lambda gateway: [gateway.continue_event(fenced_blocks).status_code],
        ),
        Case("login", "sign-in form with six fields", ("400",), login),
        Case(
            "size",
            f"{max_request_bytes - 1:,} B; {max_request_bytes + 1:,} B",
            ("200/400", "413"),
            chats(under, over),
        ),
    ]


def answered_as(status: int, expected: str) -> bool:
    return any(
        str(status) == option or (option.endswith("xx") and str(status)[0] == option[0])
        for option in expected.split("/")
    )


@dataclass
class Result:
    case: Case
    statuses: list[list[int]] = field(default_factory=list)
    worst_ms: list[float] = field(default_factory=list)
    answer_ms: list[float] = field(default_factory=list)
    """Each repeat's slowest hostile request, from its start to its answer."""
    feedback: list[tuple[int, int]] = field(default_factory=list)
    """Each repeat's feedback events taken by the gateway, and sent."""
    refusals: set[str] = field(default_factory=set)
    events: int = 0
    lag: int = -1
    growth: float | None = None
    """Its median time over that of the case it is `scaled_from`."""

    @property
    def answered(self) -> bool:
        return all(
            len(statuses) == len(self.case.expected)
            and all(map(answered_as, statuses, self.case.expected))
            for statuses in self.statuses
        )

    @property
    def passed(self) -> bool:
        return (
            self.answered
            and max(self.worst_ms) < WORST_MS_TARGET
            and self.lag == 0
            and (self.growth is None or self.growth <= GROWTH)
        )


def run_case(case: Case, gateway: Gateway, group: GroupLag, repeats: int) -> Result:
    result = Result(case)
    before = sum(group.ends().values())
    for _ in range(repeats):
        gateway.worst.clear()
        gateway.answer_s.clear()
        gateway.refusals.clear()
        gateway.feedback_sent = gateway.feedback_taken = 0
        result.statuses.append(case.attack(gateway))
        result.worst_ms.append(max(gateway.worst))
        result.answer_ms.append(max(gateway.answer_s) * 1000)
        result.feedback.append((gateway.feedback_taken, gateway.feedback_sent))
        result.refusals.update(gateway.refusals)
    result.lag = drained_lag(gateway, group)
    result.events = sum(group.ends().values()) - before
    return result


def set_growth(results: list[Result]) -> None:
    """Each scaled case's median time over that of the case it scales."""
    by_name = {result.case.name: result for result in results}
    for result in results:
        base = by_name.get(result.case.scaled_from or "")
        if base is not None:
            result.growth = statistics.median(result.answer_ms) / statistics.median(base.answer_ms)


def in_runs(statuses: list[int]) -> str:
    """`200 202 409 409 409` as `200 202 409x3` (two alike are left as they are)."""
    runs = [(status, len(list(alike))) for status, alike in groupby(statuses)]
    return " ".join(
        f"{status}x{times}" if times > 2 else " ".join([str(status)] * times)
        for status, times in runs
    )


def print_table(results: list[Result], baseline_ms: float) -> None:
    rows = [
        (
            "case",
            "what",
            "status",
            "answer ms",
            "worst /healthz ms",
            "feedback taken",
            "events",
            "lag",
            "pass",
        )
    ]
    for result in results:
        statuses = sorted({in_runs(s) for s in result.statuses})
        worst = " / ".join(f"{ms:.0f}" for ms in result.worst_ms)
        taken = sorted({f"{taken:,}/{sent:,}" for taken, sent in result.feedback if sent})
        rows.append(
            (
                result.case.name,
                result.case.what,
                " | ".join(statuses),
                f"{statistics.median(result.answer_ms):.0f}",
                f"{max(result.worst_ms):.0f} ({worst})",
                " | ".join(taken) or "-",
                str(result.events),
                str(result.lag),
                "pass" if result.passed else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print(
        f"targets: the answers as expected, worst /healthz < {WORST_MS_TARGET:.0f} ms, lag 0"
        f" after at most {DRAIN_TIMEOUT_S:.0f} s, a case {GROWTH} times another's size at most"
        f" {GROWTH} times its time; baseline worst median {baseline_ms:.0f} ms"
    )
    by_name = {result.case.name: result for result in results}
    for result in results:
        base = by_name.get(result.case.scaled_from or "")
        if base is not None and result.growth is not None:
            print(
                f"growth: {result.case.name} / {base.case.name} ({GROWTH} times the size):"
                f" {statistics.median(result.answer_ms):.1f} ms /"
                f" {statistics.median(base.answer_ms):.1f} ms = {result.growth:.2f}"
            )


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="Times each case is sent.")
    parser.add_argument("--data-dir", type=Path, default=None, help="Default: a temp dir.")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    started = time.monotonic()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="rtrl-hostile-"))
    settings = scratch_settings(data_dir)
    print(f"hostile: data in {data_dir}; starting the stack ...", flush=True)
    stack = FullStack.from_settings(
        settings, workers=1, trainer=False, progress=lambda line: print(line, flush=True)
    )
    # SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, through the `finally` below.
    on_interrupt = signal.getsignal(signal.SIGINT)
    on_term = signal.signal(signal.SIGTERM, interrupted)
    watch: HealthWatch | None = None
    group: GroupLag | None = None
    gateway: Gateway | None = None
    engine = make_engine(settings.database_url)
    results: list[Result] = []
    try:
        stack.up()
        watch = HealthWatch(stack.gateway_url)
        group = GroupLag(settings.kafka_bootstrap_servers)
        with session_scope(engine) as session:
            row, key = new_api_key(
                name="bench-hostile", role=Role.ide, rate_limit_per_minute=100_000
            )
            session.add(row)
        gateway = Gateway(stack.gateway_url, key, watch)
        watch.start()
        # The first completion after a start pays for what the gateway and vLLM set up on
        # first use, beside a worker still importing: not the baseline.
        print("warm-up: one completion, until the worker has stored it ...", flush=True)
        answer, _, _ = gateway.chat(chat_body(PROMPT))
        lag = drained_lag(gateway, group)
        print(
            f"  answered {answer.status_code}, worst /healthz {gateway.worst[-1]:.0f} ms,"
            f" lag {lag}",
            flush=True,
        )
        for case in cases(settings, args.repeats):
            print(f"{case.name}: {case.what} x {args.repeats} ...", flush=True)
            result = run_case(case, gateway, group, args.repeats)
            refused = f" ({', '.join(sorted(result.refusals))})" if result.refusals else ""
            taken = f", feedback taken/sent {result.feedback}" if result.feedback[0][1] else ""
            answers = " / ".join(f"{ms:.0f}" for ms in result.answer_ms)
            print(
                f"  answered {result.statuses}{refused} in {answers} ms, worst /healthz"
                f" {max(result.worst_ms):.0f} ms{taken}, {result.events} events, lag {result.lag}",
                flush=True,
            )
            results.append(result)
    finally:
        # A second Ctrl-C must not leave half the stack running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for close in (
            watch.stop if watch is not None and watch.started else None,
            gateway.close if gateway is not None else None,
            group.close if group is not None else None,
            engine.dispose,
        ):
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        print("hostile: stopping the stack ...", flush=True)
        stack.down(started_only=True)
        signal.signal(signal.SIGINT, on_interrupt)
        signal.signal(signal.SIGTERM, on_term)

    assert watch is not None
    set_growth(results)
    print()
    print_table(results, statistics.median(results[0].worst_ms))
    print(
        f"probes sent: {len(watch.probes)}; wall time {(time.monotonic() - started) / 60:.1f} min"
    )
    sys.exit(0 if all(result.passed for result in results[1:]) else 1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as interruption:
        print(f"hostile: interrupted ({str(interruption) or 'Ctrl-C'})", file=sys.stderr)
        sys.exit(130)
