"""The coding-task family: requests a developer types, reference solutions, hidden checks.

Shared by the model bootstrap (its corpus), the IDE simulator (what it asks, whether the
answer works) and the trainer's eval gate. A task is "write f(x) that returns x times 3"
in one of a few phrasings, in English or Chinese; an answer is a fenced Python function,
checked by running it in a restricted sandbox.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeGuard

CONSTANTS = tuple(range(2, 10))
FUNCTION_NAMES = ("f", "g", "h")
CHECK_INPUTS = (-5, -1, 0, 1, 2, 3, 7, 10, 12)
"""Chosen so every pair of operations disagrees on some input, for every constant."""


@dataclass(frozen=True)
class Operation:
    """One kind of function the family asks for, with a constant `c`."""

    name: str
    expression: str
    """Python expression of the reference solution, in `x` and `{c}`."""
    compute: Callable[[int, int], int]
    phrasings_en: tuple[str, ...]
    phrasings_zh: tuple[str, ...]


OPERATIONS = (
    Operation(
        "plus",
        "x + {c}",
        lambda x, c: x + c,
        ("x plus {c}", "the sum of x and {c}", "x increased by {c}"),
        ("x 加 {c}",),
    ),
    Operation(
        "minus",
        "x - {c}",
        lambda x, c: x - c,
        ("x minus {c}", "x decreased by {c}", "the difference of x and {c}"),
        ("x 减 {c}",),
    ),
    Operation(
        "times",
        "x * {c}",
        lambda x, c: x * c,
        ("x times {c}", "x multiplied by {c}", "the product of x and {c}"),
        ("x 乘以 {c}",),
    ),
    Operation(
        "squared_plus",
        "x * x + {c}",
        lambda x, c: x * x + c,
        ("x squared plus {c}", "the square of x, plus {c}"),
        ("x 的平方加 {c}",),
    ),
    Operation(
        "larger",
        "max(x, {c})",
        lambda x, c: max(x, c),
        ("the larger of x and {c}", "the maximum of x and {c}"),
        ("x 和 {c} 中较大的那个",),
    ),
    Operation(
        "smaller",
        "min(x, {c})",
        lambda x, c: min(x, c),
        ("the smaller of x and {c}", "the minimum of x and {c}"),
        ("x 和 {c} 中较小的那个",),
    ),
    Operation(
        "modulo",
        "x % {c}",
        lambda x, c: x % c,
        ("x modulo {c}", "the remainder of x divided by {c}"),
        ("x 除以 {c} 的余数",),
    ),
    Operation(
        "distance",
        "abs(x - {c})",
        lambda x, c: abs(x - c),
        ("the distance between x and {c}", "the absolute difference of x and {c}"),
        ("x 与 {c} 的距离",),
    ),
)
OPERATIONS_BY_NAME = {operation.name: operation for operation in OPERATIONS}

REQUEST_TEMPLATES = {
    "en": (
        "Write {fn}(x) that returns {phrase}.",
        "Define a function {fn}(x) that returns {phrase}.",
        "Implement {fn}(x): it should return {phrase}.",
    ),
    "zh": (
        "写一个函数 {fn}(x)，返回 {phrase}。",
        "实现 {fn}(x)，使它返回 {phrase}。",
    ),
}

Language = Literal["en", "zh"]
Split = Literal["all", "train", "heldout"]


@dataclass(frozen=True)
class Task:
    """One request a developer types, its reference solution and its hidden checks."""

    task_id: str
    request: str
    reference: str
    function_name: str
    operation: str
    constant: int
    language: Language
    checks: tuple[tuple[int, int], ...]
    """(input, expected output) pairs the answer's function must reproduce."""


def is_heldout(operation: str, constant: int) -> bool:
    """Whether this (operation, constant) pair is kept out of the bootstrap corpus."""
    # About one pair in five, spread so every operation and every constant still occurs
    # in training: a held-out pair tests composing known skills, not learning new ones.
    return (OPERATIONS.index(OPERATIONS_BY_NAME[operation]) + constant) % 5 == 0


def reference_code(function_name: str, expression: str, constant: int) -> str:
    """The canonical source of a one-line function returning `expression`."""
    return f"def {function_name}(x):\n    return {expression.format(c=constant)}\n"


def format_response(code: str) -> str:
    """An assistant response that proposes `code`, in the format the model is taught."""
    return f"```python\n{code}```"


def make_task(
    operation: Operation,
    constant: int,
    function_name: str,
    language: Language,
    template_index: int,
    phrasing_index: int,
) -> Task:
    """Build one task; its id is stable as long as phrasing lists are only appended to."""
    phrasings = operation.phrasings_en if language == "en" else operation.phrasings_zh
    phrase = phrasings[phrasing_index].format(c=constant)
    request = REQUEST_TEMPLATES[language][template_index].format(fn=function_name, phrase=phrase)
    return Task(
        task_id=(
            f"{operation.name}-{constant}-{function_name}-{language}"
            f"-{template_index}-{phrasing_index}"
        ),
        request=request,
        reference=reference_code(function_name, operation.expression, constant),
        function_name=function_name,
        operation=operation.name,
        constant=constant,
        language=language,
        checks=tuple((x, operation.compute(x, constant)) for x in CHECK_INPUTS),
    )


def all_tasks(split: Split = "all") -> list[Task]:
    """Every task of the family in a fixed order, optionally only one side of the split."""
    tasks = []
    for operation in OPERATIONS:
        for constant in CONSTANTS:
            heldout = is_heldout(operation.name, constant)
            if (split == "train" and heldout) or (split == "heldout" and not heldout):
                continue
            for function_name in FUNCTION_NAMES:
                for language, templates in REQUEST_TEMPLATES.items():
                    phrasings = (
                        operation.phrasings_en if language == "en" else operation.phrasings_zh
                    )
                    for template_index in range(len(templates)):
                        for phrasing_index in range(len(phrasings)):
                            tasks.append(
                                make_task(
                                    operation,
                                    constant,
                                    function_name,
                                    language,  # type: ignore[arg-type]
                                    template_index,
                                    phrasing_index,
                                )
                            )
    return tasks


def generate_tasks(seed: int, n: int, split: Split = "all") -> list[Task]:
    """`n` tasks drawn deterministically: all distinct while the split has enough, then
    each task once more per pass, in a fresh order each pass."""
    pool = all_tasks(split)
    rng = random.Random(seed)
    tasks: list[Task] = []
    while len(tasks) < n:
        order = pool[:]
        rng.shuffle(order)
        tasks.extend(order[: n - len(tasks)])
    return tasks


def train_tasks(seed: int, n: int) -> list[Task]:
    """Tasks whose (operation, constant) pair the bootstrap corpus may contain."""
    return generate_tasks(seed, n, "train")


def heldout_tasks(seed: int, n: int) -> list[Task]:
    """Tasks whose (operation, constant) pair the bootstrap corpus never contains."""
    return generate_tasks(seed, n, "heldout")


_FENCE_OPEN = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n")


def extract_code(completion_text: str) -> str | None:
    """The code a response proposes: its first fenced block (the closing fence may be
    missing), else the text from its first `def` on; None when it proposes no code."""
    fence = _FENCE_OPEN.search(completion_text)
    if fence is not None:
        body = completion_text[fence.end() :]
        closing = body.find("```")
        code = body if closing < 0 else body[:closing]
        return code if code.strip() else None
    definition = re.search(r"^def ", completion_text, re.MULTILINE)
    if definition is None:
        return None
    return completion_text[definition.start() :]


# The sandbox: a solution may use only these nodes, so it cannot loop, recurse, import,
# reach attributes or build large objects, and always finishes in microseconds. No
# assignments and no powers of powers, so no chain of squarings can grow a huge integer.
_ALLOWED_NODES = (
    ast.Module,
    ast.FunctionDef,
    ast.arguments,
    ast.arg,
    ast.Return,
    ast.If,
    ast.Expr,
    ast.Pass,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.USub,
    ast.UAdd,
    ast.Not,
    ast.And,
    ast.Or,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
)
_ALLOWED_CALLS = {"max": max, "min": min, "abs": abs}
_MAX_SOURCE_CHARS = 2000
_MAX_NODES = 200
_MAX_EXPONENT = 8
_MAX_CONSTANT = 10**9


def _is_safe(tree: ast.Module, function_name: str) -> bool:
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return False
    function = tree.body[0]
    arguments = function.args
    if (
        function.name != function_name
        or function.decorator_list
        or getattr(function, "type_params", None)
        or len(arguments.args) != 1
        or arguments.posonlyargs
        or arguments.kwonlyargs
        or arguments.vararg
        or arguments.kwarg
        or arguments.defaults
    ):
        return False
    nodes = list(ast.walk(tree))
    if len(nodes) > _MAX_NODES:
        return False
    for node in nodes:
        if not isinstance(node, _ALLOWED_NODES):
            return False
        if isinstance(node, ast.Name) and "__" in node.id:
            return False
        if isinstance(node, ast.Constant):
            if isinstance(node.value, int | float):
                if abs(node.value) > _MAX_CONSTANT:
                    return False
            # A docstring is the one string allowed: an expression statement on its own.
            elif not isinstance(node.value, str) or len(node.value) > 500:
                return False
        if isinstance(node, ast.Expr) and not (
            isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        ):
            return False
        if _is_power(node):
            exponent = node.right
            if not (
                isinstance(exponent, ast.Constant)
                and type(exponent.value) is int
                and 0 <= exponent.value <= _MAX_EXPONENT
            ) or any(_is_power(inner) for inner in ast.walk(node.left)):
                return False
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name)
            or node.func.id not in _ALLOWED_CALLS
            or node.keywords
            or len(node.args) > 4
        ):
            return False
    return True


def _is_power(node: ast.AST) -> TypeGuard[ast.BinOp]:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)


def check_solution(task: Task, code: str) -> bool:
    """Whether `code` defines the requested function and it passes the task's checks.

    Safe on untrusted model output: anything outside a small arithmetic subset of Python
    is rejected before it runs, and any error while running counts as a failure.
    """
    if len(code) > _MAX_SOURCE_CHARS:
        return False
    try:
        tree = ast.parse(code)
        if not _is_safe(tree, task.function_name):
            return False
        # Type hints such as `x: int` would name builtins the sandbox does not have.
        function_def = tree.body[0]
        assert isinstance(function_def, ast.FunctionDef)
        function_def.args.args[0].annotation = None
        function_def.returns = None
        namespace: dict[str, object] = {"__builtins__": {}, **_ALLOWED_CALLS}
        exec(compile(tree, "<solution>", "exec"), namespace)
        function = namespace[task.function_name]
        if not callable(function):
            return False
        for argument, expected in task.checks:
            result = function(argument)
            if type(result) not in (int, float) or result != expected:
                return False
    except Exception:
        return False
    return True
