"""What a developer writes after an answer, in English or Chinese, as people write it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from sandbox.tasks import Language, Task

FailureKind = Literal["no_code", "syntax_error", "wrong_name", "wrong_result"]


@dataclass(frozen=True)
class Failure:
    """Why an answer did not do what the task asked, as the developer saw it."""

    kind: FailureKind
    argument: int | None = None
    """wrong_result: the first input the function got wrong."""
    expected: int | None = None
    """wrong_result: what it should have returned for `argument`."""
    line: str = ""
    """syntax_error: the line the parser stopped at."""


MOVING_ON = {
    "en": (
        "thanks, next one",
        "great, next:",
        "ok, moving on",
        "perfect, thanks",
        "lgtm",
        "nice. now the next one",
        "works, thanks!",
        "cool",
    ),
    "zh": (
        "好的，下一个",
        "可以，继续",
        "谢谢，下一个",
        "没问题，继续下一个",
        "好，下一题",
        "行，接着来",
    ),
}

# A few phrasings are ones a rule-based classifier may well miss ("hmm, should give …"):
# real users are not that explicit every time.
COMPLAINTS: dict[FailureKind, dict[Language, tuple[str, ...]]] = {
    "wrong_result": {
        "en": (
            "still broken: {call} should be {expected}",
            "that's wrong, {call} should return {expected}",
            "doesn't work. {call} should be {expected}",
            "no, {call} is supposed to be {expected}",
            "the tests fail, {call} needs to return {expected}",
            "you got it wrong again, {call} must be {expected}",
            "that's not what I asked for. {request}",
            "hmm, {call} should give {expected}",
            "this is wrong for x={x}: expected {expected}",
        ),
        "zh": (
            "不对，{call} 应该是 {expected}",
            "结果错了，{call} 应该返回 {expected}",
            "还是不行，{call} 应该等于 {expected}",
            "测试没过：{call} 应该是 {expected}",
            "这不是我要的，{request}",
            "{call} 的结果好像不太对吧，应该是 {expected}",
        ),
    },
    "no_code": {
        "en": (
            "where's the code? I asked for a function",
            "no, I need the actual function {fn}(x)",
            "that's not what I asked. write {fn}(x) please",
            "you didn't write any code",
        ),
        "zh": (
            "代码呢？我说了要写函数",
            "不是这个意思，直接写 {fn}(x) 的代码",
            "没有代码啊",
        ),
    },
    "syntax_error": {
        "en": (
            "it doesn't even compile",
            "syntax error, doesn't run",
            "still broken, that's not valid python",
        ),
        "zh": (
            "语法错误，跑不起来",
            "运行报错了，语法有问题",
        ),
    },
    "wrong_name": {
        "en": (
            "you used the wrong name, I need {fn}(x)",
            "no, the function has to be called {fn}",
            "that's not what I asked, it should be {fn}(x)",
        ),
        "zh": (
            "函数名不对，我要的是 {fn}",
            "不是我要的，函数应该叫 {fn}",
        ),
    },
}

PASTE_SHARE = 0.25
"""Share of complaints that are a pasted error output, as developers paste what they ran."""
PASTE_PREFACES = {
    "en": ("", "", "still failing:\n", "got this:\n", "hmm\n"),
    "zh": ("", "报错了：\n", "跑出来是这样：\n", "又错了\n"),
}
IMPATIENT_REMARKS = {
    "en": ("that took forever.", "slow today...", "finally.", "took a while."),
    "zh": ("好慢啊。", "等了半天。", "怎么这么慢。"),
}


def pasted_output(task: Task, failure: Failure, rng: random.Random) -> str:
    """The error output a developer would get running the answer, as they would paste it."""
    fn = task.function_name
    if failure.kind == "syntax_error":
        return (
            '  File "/home/dev/project/solution.py", line 2\n'
            f"    {failure.line.strip()[:120]}\n"
            "    ^\n"
            "SyntaxError: invalid syntax"
        )
    if failure.kind in ("wrong_name", "no_code"):
        return (
            "Traceback (most recent call last):\n"
            '  File "/home/dev/project/test_solution.py", line 1, in <module>\n'
            f"    from solution import {fn}\n"
            f"ImportError: cannot import name '{fn}' from 'solution'"
        )
    assertion = f"assert {fn}({failure.argument}) == {failure.expected}"
    if rng.random() < 0.5:
        return (
            "Traceback (most recent call last):\n"
            '  File "/home/dev/project/check.py", line 4, in <module>\n'
            f"    {assertion}\n"
            "AssertionError"
        )
    return (
        f"    def test_{fn}():\n"
        f">       {assertion}\n"
        "E       AssertionError\n\n"
        "test_solution.py:4: AssertionError\n"
        f"FAILED test_solution.py::test_{fn} - AssertionError"
    )


def complaint(task: Task, failure: Failure, rng: random.Random) -> str:
    """A dissatisfied follow-up about a failed answer, sometimes with the pasted error."""
    if rng.random() < PASTE_SHARE:
        return rng.choice(PASTE_PREFACES[task.language]) + pasted_output(task, failure, rng)
    template = rng.choice(COMPLAINTS[failure.kind][task.language])
    return template.format(
        fn=task.function_name,
        x=failure.argument,
        call=f"{task.function_name}({failure.argument})",
        expected=failure.expected,
        request=task.request,
    )


def moving_on(task: Task, rng: random.Random) -> str:
    """A follow-up that accepts the answer and moves to the next task."""
    return rng.choice(MOVING_ON[task.language])


def impatient_remark(language: Language, rng: random.Random) -> str:
    """What a developer says when the answer took longer than they were willing to wait."""
    return rng.choice(IMPATIENT_REMARKS[language])
