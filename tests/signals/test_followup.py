import json
from pathlib import Path
from typing import Any

import pytest

from app.signals.followup import explain, is_dissatisfied

LABELLED = Path(__file__).parent / "data" / "followup_messages.jsonl"


def load_labelled() -> list[dict[str, Any]]:
    with LABELLED.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def precision_recall(rows: list[dict[str, Any]]) -> tuple[float, float]:
    predicted = [is_dissatisfied(row["message"]) for row in rows]
    actual = [row["dissatisfied"] for row in rows]
    true_pos = sum(p and a for p, a in zip(predicted, actual, strict=True))
    return true_pos / max(sum(predicted), 1), true_pos / max(sum(actual), 1)


def test_labelled_set_is_what_it_claims() -> None:
    rows = load_labelled()
    assert len(rows) >= 240
    assert sum(row["lang"] == "zh" for row in rows) >= 60
    assert sum(row.get("note") == "stack trace" for row in rows) >= 30
    assert sum(row.get("note") == "hard negative" for row in rows) >= 40
    share_dissatisfied = sum(row["dissatisfied"] for row in rows) / len(rows)
    assert 0.4 <= share_dissatisfied <= 0.6
    share_holdout = sum(row.get("split") == "holdout" for row in rows) / len(rows)
    assert 0.25 <= share_holdout <= 0.35


@pytest.mark.parametrize(
    ("split", "floor"),
    [("all", 0.9), ("holdout", 0.85)],
)
def test_precision_and_recall_on_labelled_set(
    split: str, floor: float, record_property: Any
) -> None:
    rows = load_labelled()
    if split == "holdout":
        rows = [row for row in rows if row.get("split") == "holdout"]
    precision, recall = precision_recall(rows)
    print(
        f"followup classifier, {split} ({len(rows)}): precision={precision:.3f} recall={recall:.3f}"
    )
    record_property(f"{split}_precision", round(precision, 3))
    record_property(f"{split}_recall", round(recall, 3))
    misses = [
        (row["message"][:80], explain(row["message"]))
        for row in rows
        if is_dissatisfied(row["message"]) != row["dissatisfied"]
    ]
    assert precision >= floor and recall >= floor, misses


@pytest.mark.parametrize(
    "message",
    [
        'Traceback (most recent call last):\n  File "app.py", line 3, in <module>\n'
        "    main()\nKeyError: 'user_id'",
        "FAILED tests/test_cart.py::test_discount - AssertionError: assert 81 == 90",
        "still failing",
        "revert that",
        "no, I said sort by date",
        "不对",
        "还是报错",
        "撤销刚才的修改",
        "thanks, but it still crashes",
    ],
)
def test_complaints_are_dissatisfied(message: str) -> None:
    assert is_dissatisfied(message), explain(message)


@pytest.mark.parametrize(
    "message",
    [
        "thanks, revert is not needed",
        "no problem",
        "not bad at all",
        "this fixed the error, thanks",
        "write a function that raises ValueError on bad input",
        "how do I revert a git commit?",
        "if the upload fails, show a toast",
        "好的，谢谢",
        "没报错了，谢谢",
        "不对称加密用哪个库？",
        "============ 42 passed in 3.21s ============",
    ],
)
def test_neutral_follow_ups_are_not(message: str) -> None:
    assert not is_dissatisfied(message), explain(message)


def test_explain_names_the_rules_that_fired() -> None:
    assert explain("still failing") == ["still_broken +3: 'still failing'"]
    assert explain("how do I revert a git commit?") == []
    assert explain("没报错了，谢谢") == ["zh_error suppressed by '没': '报错'", "thanks -1: '谢谢'"]
    assert explain("Great, you removed the debug prints") == [
        "you_undid_my_work +2: 'you removed'",
        "praise -1: 'great'",
    ]


HOSTILE_FOLLOWUPS = {
    "blank lines": "\n" * 16_000,
    "indented blank lines": "    \n" * 3_200,
    "spaces and newlines": " \t\n" * 5_333,
    "one long word": "a" * 16_000,
    "an unclosed tool call": "<tool_call>" + "\n" * 15_989,
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", HOSTILE_FOLLOWUPS)
def test_a_hostile_follow_up_is_classified_in_linear_time(name: str) -> None:
    # 16,000 characters, the most a follow-up carries: 4,000 newlines alone took 3.4 s when a
    # rule's `^\s*` ran over every newline after each line start (16,000 would take about a
    # minute); linear rules take tens of milliseconds. The limit only catches a hang.
    assert not is_dissatisfied(HOSTILE_FOLLOWUPS[name])
    assert is_dissatisfied(HOSTILE_FOLLOWUPS[name] + "\nTraceback (most recent call last):")


@pytest.mark.timeout(10)
def test_a_message_that_opens_like_a_stack_frame_is_read_in_linear_time() -> None:
    # `" at " + 15,996 letters` took ~1 s a message when a frame's name and location could
    # split the line anywhere; sixty of them in one feedback POST held a gateway ~51 s.
    frame_like = " at " + "a" * 15_996
    for _ in range(20):
        assert not is_dissatisfied(frame_like)
    frames = "    at com.acme.Calc.add(Calc.java:42)\n    at Object.<anonymous> (/src/calc.js:10:5)"
    assert any(line.startswith("stack_frame") for line in explain(frames))
