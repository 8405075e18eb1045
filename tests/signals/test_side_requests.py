"""The stock clients' side requests, as they word them, told apart from their turns."""

from __future__ import annotations

from typing import Any

import pytest

from app.signals.side_requests import side_request

TASK = {"role": "user", "content": "Fix the bug in calc.py."}


def history(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a coding agent."}, TASK, *messages]


@pytest.mark.parametrize(
    ("messages", "kind"),
    [
        # opencode and Kilo: the first request of every session.
        (
            [
                {
                    "role": "system",
                    "content": "You are a title generator. You output ONLY a thread title.",
                },
                TASK,
            ],
            "title",
        ),
        # Codex TUI.
        (
            [
                {
                    "role": "user",
                    "content": "Generate a concise, single-line task title for this"
                    " request: Fix the bug in calc.py.",
                }
            ],
            "title",
        ),
        # Continue TUI.
        (
            history(
                {"role": "assistant", "content": "Done."},
                {
                    "role": "user",
                    "content": "please reply with a title for the chat that is 3-4 words",
                },
            ),
            "title",
        ),
        # aider, after every edit.
        (
            [
                {
                    "role": "system",
                    "content": "You are an expert software engineer that generates"
                    " concise, one-line Git commit messages based on the provided diffs.",
                },
                {"role": "user", "content": "# Diffs:\ndiff --git a/calc.py b/calc.py"},
            ],
            "commit_message",
        ),
        # Qwen Code TUI.
        (
            history(
                {"role": "assistant", "content": "Done."},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "[SUGGESTION MODE:"
                            " Suggest what the user might naturally type next.]",
                        }
                    ],
                },
            ),
            "suggestion",
        ),
        # Claude Code compacting its history.
        (
            history(
                {"role": "assistant", "content": "Done."},
                {
                    "role": "user",
                    "content": "Your task is to create a detailed summary of"
                    " the conversation so far.",
                },
            ),
            "summary",
        ),
        (history(), None),
        (
            history(
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "Give the summary a better title."},
            ),
            None,
        ),
    ],
)
def test_a_side_request_is_known_by_its_clients_words(
    messages: list[dict[str, Any]], kind: str | None
) -> None:
    assert side_request(messages) == kind
