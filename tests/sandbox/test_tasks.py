import time

import pytest

from sandbox.tasks import (
    OPERATIONS,
    all_tasks,
    check_solution,
    extract_code,
    format_response,
    generate_tasks,
    heldout_tasks,
    train_tasks,
)

TASKS = all_tasks()


def times_task(constant: int = 3, function_name: str = "f"):
    return next(
        task
        for task in TASKS
        if task.operation == "times"
        and task.constant == constant
        and task.function_name == function_name
    )


def test_every_reference_solution_passes_its_checks() -> None:
    assert all(check_solution(task, task.reference) for task in TASKS)


def test_another_operations_solution_fails() -> None:
    for task in TASKS[::7]:
        for operation in OPERATIONS:
            if operation.name == task.operation:
                continue
            wrong = f"def {task.function_name}(x):\n    return "
            wrong += operation.expression.format(c=task.constant) + "\n"
            assert not check_solution(task, wrong), (task.task_id, operation.name)


def test_wrong_constant_or_function_name_fails() -> None:
    task = times_task(constant=3, function_name="f")
    assert check_solution(task, "def f(x):\n    return x * 3\n")
    assert not check_solution(task, "def f(x):\n    return x * 4\n")
    assert not check_solution(task, "def g(x):\n    return x * 3\n")
    assert not check_solution(task, "")
    assert not check_solution(task, "def f(x):\n    return x *")


def test_equivalent_solutions_pass() -> None:
    task = times_task(constant=3)
    for code in [
        "def f(x):\n    return 3 * x\n",
        "def f(x: int) -> int:\n    '''Triple it.'''\n    return x + x + x\n",
        "def f(x):\n    if x < 0:\n        return -(abs(x) * 3)\n    return max(x * 3, 0)\n",
        "def f(x):\n    return x * 3.0\n",
    ]:
        assert check_solution(task, code), code


@pytest.mark.parametrize(
    "code",
    [
        "import os\ndef f(x):\n    return x * 3\n",
        "def f(x):\n    import os\n    return x * 3\n",
        "def f(x):\n    return x.__class__\n",
        "def f(x):\n    return (3).real * x\n",
        "def f(x):\n    while True:\n        pass\n",
        "def f(x):\n    for _ in range(10**9):\n        pass\n    return x * 3\n",
        "def f(x):\n    return __import__('os').getpid()\n",
        "def f(x):\n    return open('/etc/passwd')\n",
        "def f(x):\n    return f(x)\n",
        "def f(x):\n    return (lambda: x * 3)()\n",
        "def f(x):\n    return 9 ** 9 ** 9 ** 9\n",
        "def f(x):\n    return x ** 999999999\n",
        "def f(x):\n    return ((x ** 8) ** 8) ** 8\n",
        "def f(x):\n    return [x] * 10 ** 9\n",
        "def f(x):\n    return 'a' * 10 ** 9\n",
        "def f(x):\n    y = x * x\n    y = y * y\n    return y\n",
        "def f(x):\n    return 99999999999999999999 ** 8\n",
        "@staticmethod\ndef f(x):\n    return x * 3\n",
        "def f(*x):\n    return x * 3\n",
        "def f(x):\n    return x * 3\nprint(1)\n",
        "def f(x):\n    return x * 3\ndef g(x):\n    return x\n",
        "def f(x):\n    return x * 3" + " + 0" * 300 + "\n",
    ],
)
def test_sandbox_rejects_unsafe_code_fast(code: str) -> None:
    started = time.perf_counter()
    assert not check_solution(times_task(), code)
    assert time.perf_counter() - started < 0.1


def test_runtime_errors_count_as_failures() -> None:
    task = times_task()
    assert not check_solution(task, "def f(x):\n    return x * 3 / (x - x)\n")
    assert not check_solution(task, "def f(x):\n    return undefined_name\n")
    assert not check_solution(task, "def f(x):\n    return max(x)\n")
    assert not check_solution(task, "def f(x):\n    return x > 0\n")


def test_extract_code_from_fenced_and_unfenced_responses() -> None:
    code = "def f(x):\n    return x * 3\n"
    assert extract_code(format_response(code)) == code
    assert extract_code(f"Here you go:\n```python\n{code}```\nIt triples x.") == code
    assert extract_code(f"```py\n{code}```") == code
    assert extract_code(f"```\n{code}```") == code
    assert extract_code(f"```python\n{code}") == code
    assert extract_code(f"Sure.\n{code}") == code
    assert extract_code("I am not sure what you mean.") is None
    assert extract_code("```python\n```") is None


def test_generation_is_deterministic_and_split_holds_out_pairs() -> None:
    assert generate_tasks(7, 50) == generate_tasks(7, 50)
    assert generate_tasks(7, 50) != generate_tasks(8, 50)
    train_pairs = {(task.operation, task.constant) for task in train_tasks(0, 5000)}
    heldout_pairs = {(task.operation, task.constant) for task in heldout_tasks(0, 5000)}
    assert heldout_pairs and not heldout_pairs & train_pairs
    assert {operation for operation, _ in heldout_pairs} == {op.name for op in OPERATIONS}
    assert {operation for operation, _ in train_pairs} == {op.name for op in OPERATIONS}


def test_tasks_are_distinct_until_the_split_is_exhausted() -> None:
    pool = all_tasks("heldout")
    tasks = heldout_tasks(0, len(pool) + 10)
    assert len({task.task_id for task in tasks[: len(pool)]}) == len(pool)
    assert {task.language for task in TASKS} == {"en", "zh"}


def test_requests_name_the_function_and_constant() -> None:
    for task in TASKS:
        assert f"{task.function_name}(x)" in task.request
        assert str(task.constant) in task.request
