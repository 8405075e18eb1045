"""The agentic task family: a small workspace, tools an agent IDE declares, hidden checks.

Each task is one coding task of `sandbox.tasks` put in a workspace: a file holding a stub or a
wrong version of the function, and a request to fix it. The agent works through the tools
agent IDEs declare — `read_file`, `edit_file` (exact string replacement, as Claude Code and
Cursor name it) and `run_tests` — and ends with a final answer; the hidden checks then judge
the file. The split is the family's: held-out tasks combine known skills in unseen ways.

Shared by the bootstrap (its corpus of agent runs), the IDE simulator (which runs the tools
and judges the workspace) and the tests.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from sandbox.tasks import Task, check_solution, generate_tasks

MAX_TURNS = 6
"""Turns an IDE lets one agent run take before it stops the agent."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace the one occurrence of old_string in the file by new_string.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old_string": {"type": "string"},
                    "new_string": {"type": "string"},
                },
                "required": ["path", "old_string", "new_string"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the workspace's tests.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
TOOL_NAMES = frozenset(tool["function"]["name"] for tool in TOOLS)
REQUIRED_ARGUMENTS = {
    tool["function"]["name"]: tuple(tool["function"]["parameters"].get("required", ()))
    for tool in TOOLS
}

FILES = {"f": "calc.py", "g": "geometry.py", "h": "helpers.py"}
"""Where each function of the family lives."""
STARTING_BODIES = ("return x", "return 0", "return x + 1", "return -x", "pass")
"""What the function returns before the fix: a stub or a wrong version, drawn per task."""
DONE = ("Done.", "完成了。")
"""The final answer after an edit, by language."""


@dataclass(frozen=True)
class AgentTask:
    """A coding task set in a workspace: the file, what it holds before the fix, the request."""

    task: Task
    path: str
    starting_body: str
    request: str

    @property
    def task_id(self) -> str:
        return f"{self.task.task_id}-{STARTING_BODIES.index(self.starting_body)}"

    @property
    def starting_file(self) -> str:
        return f"def {self.task.function_name}(x):\n    {self.starting_body}\n"

    @property
    def fixed_body(self) -> str:
        """The line the reference solution has where the starting file has `starting_body`."""
        return self.task.reference.splitlines()[1].strip()


def agent_task(task: Task, rng: random.Random) -> AgentTask:
    """Put `task` in a workspace with a starting body drawn from `rng`."""
    path = FILES[task.function_name]
    if task.language == "zh":
        request = f"{task.request} 函数在 {path} 里。"
    else:
        request = f"{task.request} It lives in {path}."
    return AgentTask(task, path, rng.choice(STARTING_BODIES), request)


def agent_tasks(seed: int, n: int, split: str = "all") -> list[AgentTask]:
    """`n` agentic tasks drawn deterministically from one side of the family's split."""
    rng = random.Random(seed)
    return [agent_task(task, rng) for task in generate_tasks(seed, n, split)]  # type: ignore[arg-type]


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant tool call in the OpenAI shape, its arguments as JSON text written the way
    vLLM's tool parser and the chat template's `tojson` write them (", " and ": ")."""
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""A tool call as the base model writes it and vLLM's `hermes` parser reads it."""


def written_calls(text: str) -> list[dict[str, Any] | None]:
    """The tool calls written in a model's raw text, in order, each as `tool_call` makes it,
    or None where one cannot be read (not JSON, no name or arguments, or a tag never closed)."""
    # The blocks' whitespace is stripped here, not by the pattern: `\s*(.*?)\s*` is quadratic
    # in a long run of whitespace after an unclosed tag.
    blocks = [block.strip() for block in HERMES_CALL.findall(text)]
    if not blocks:
        return [None] if "<tool_call>" in text else []
    calls: list[dict[str, Any] | None] = []
    for block in blocks:
        try:
            call = json.loads(block)
            calls.append(tool_call(call["name"], call["arguments"]))
        except (ValueError, KeyError, TypeError):
            calls.append(None)
    return calls


@dataclass
class Workspace:
    """The files of one agent run, changed only through the tools."""

    files: dict[str, str]
    edits: int = 0
    """Successful edits so far."""
    read_before_edit: bool = True
    """False once a file was edited before anything was read."""
    reads: int = 0
    log: list[str] = field(default_factory=list)

    @classmethod
    def for_task(cls, task: AgentTask) -> Workspace:
        return cls({task.path: task.starting_file})

    def run(self, task: AgentTask, name: str | None, arguments: str | None) -> tuple[str, bool]:
        """Execute one tool call; its result text and whether the call was well formed."""
        if name not in TOOL_NAMES:
            return (
                f"error: unknown tool {name!r}; the tools are {', '.join(sorted(TOOL_NAMES))}",
                False,
            )
        try:
            parsed = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            return "error: the arguments are not valid JSON", False
        if not isinstance(parsed, dict):
            return "error: the arguments must be a JSON object", False
        missing = [key for key in REQUIRED_ARGUMENTS[name] if not isinstance(parsed.get(key), str)]
        if missing:
            return f"error: missing required argument {missing[0]!r}", False
        if name == "read_file":
            self.reads += 1
            content = self.files.get(parsed["path"])
            return (content if content is not None else f"error: no file {parsed['path']!r}"), True
        if name == "edit_file":
            return self._edit(parsed["path"], parsed["old_string"], parsed["new_string"]), True
        passed = check_solution(task.task, self.files.get(task.path, ""))
        return ("passed" if passed else "failed"), True

    def _edit(self, path: str, old: str, new: str) -> str:
        content = self.files.get(path)
        if content is None:
            return f"error: no file {path!r}"
        if not old or content.count(old) != 1:
            return "error: old_string must occur exactly once in the file"
        if self.reads == 0:
            self.read_before_edit = False
        self.files[path] = content.replace(old, new, 1)
        self.edits += 1
        return "ok"

    def solves(self, task: AgentTask) -> bool:
        """Whether the workspace's file passes the task's hidden checks."""
        return check_solution(task.task, self.files.get(task.path, ""))

    def final_code(self, task: AgentTask) -> str:
        return self.files.get(task.path, "")


def reference_messages(task: AgentTask) -> list[dict[str, Any]]:
    """The ideal run, as chat messages after the request: read, edit, final answer."""
    read = tool_call("read_file", {"path": task.path})
    edit = tool_call(
        "edit_file",
        {"path": task.path, "old_string": task.starting_body, "new_string": task.fixed_body},
    )
    done = DONE[task.task.language == "zh"]
    return [
        {"role": "user", "content": task.request},
        _call_message(read, "call_0"),
        {"role": "tool", "tool_call_id": "call_0", "content": task.starting_file},
        _call_message(edit, "call_1"),
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "assistant", "content": done},
    ]


def _call_message(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": call}],
    }
