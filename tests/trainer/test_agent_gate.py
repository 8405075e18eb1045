"""Agent runs offline: each answer's calls run in the workspace as the simulated IDE runs
them, malformed ones counted, a run ending on an answer without a call; and the evaluation
gate built on them, which scores a policy that breaks its tool calls below its parent; and the
comparison of two policies' runs, whose intervals are over runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from transformers import PreTrainedTokenizerFast

from sandbox.agent_runs import (
    AgentRun,
    AgentTaskHeldOut,
    clean_solve_rate,
    compare_over_runs,
    load_policy,
    take_turn,
)
from sandbox.agent_tasks import Workspace, agent_task
from sandbox.tasks import train_tasks
from tests.conftest import fine_tune_toward_malformed_calls


def a_run() -> AgentRun:
    task = agent_task(train_tasks(0, 1)[0], random.Random(0))
    return AgentRun(task, Workspace.for_task(task), [{"role": "user", "content": task.request}])


def call(name: str, **arguments: str) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_read_and_a_fixing_edit_solve_the_run() -> None:
    run = a_run()
    task = run.task
    take_turn(run, call("read_file", path=task.path), 0)
    assert run.messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_0_0",
        "content": task.starting_file,
    }
    take_turn(
        run,
        call(
            "edit_file", path=task.path, old_string=task.starting_body, new_string=task.fixed_body
        ),
        1,
    )
    take_turn(run, "Done.", 2)
    assert run.done and run.solved
    assert (run.calls, run.malformed, run.first_turn_question) == (2, 0, False)


def test_malformed_calls_are_counted_and_a_first_turn_question_ends_the_run() -> None:
    run = a_run()
    take_turn(run, call("write_file", path=run.task.path), 0)  # an unknown tool
    take_turn(run, '<tool_call>\n{"name": "read_file", "arguments": {"path": ', 1)  # cut off
    assert run.done and not run.solved
    assert (run.calls, run.malformed) == (2, 2)
    asking = a_run()
    take_turn(asking, "Which file should I change?", 0)
    assert asking.done and asking.first_turn_question and asking.calls == 0


def test_only_a_run_solved_without_a_malformed_call_counts_as_clean() -> None:
    solved, stumbled, failed = a_run(), a_run(), a_run()
    for run in (solved, stumbled):
        task = run.task
        if run is stumbled:
            take_turn(run, call("open_file", path=task.path), 0)
        take_turn(run, call("read_file", path=task.path), 1)
        take_turn(
            run,
            call(
                "edit_file",
                path=task.path,
                old_string=task.starting_body,
                new_string=task.fixed_body,
            ),
            2,
        )
    take_turn(failed, "Done.", 0)
    assert solved.solved and stumbled.solved and not failed.solved
    assert clean_solve_rate([solved, stumbled, failed]) == pytest.approx(1 / 3)
    assert clean_solve_rate([]) == 0.0


@pytest.mark.scenario
@pytest.mark.slow
def test_the_agent_gate_scores_a_candidate_that_breaks_its_tool_calls_below_its_parent(
    agent_model_dir: Path, tmp_path: Path
) -> None:
    # The parent is the base that solves agent runs (the bootstrap's check holds it to 30% of
    # its validation runs); the 500-step base solves as few as 1.6% of these on some CPUs,
    # where no candidate can score below it. Fine-tuned toward malformed calls, the candidate
    # solves held-out runs cleanly about half as often as its parent (25.0% → 13.3% of 128).
    hacked = tmp_path / "hacked"
    fine_tune_toward_malformed_calls(agent_model_dir, hacked)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(agent_model_dir)
    held_out = AgentTaskHeldOut(tasks=128)
    production = held_out.pass_rate(load_policy(agent_model_dir), tokenizer)
    candidate = held_out.pass_rate(load_policy(agent_model_dir, hacked), tokenizer)
    print(f"clean solves: production {production:.3f}, candidate {candidate:.3f}")
    assert candidate < production
    # Scored the same way again, the same policy gets the same rate: the gate's runs are
    # seeded, so production and candidate meet the same tasks in the same random stream.
    assert held_out.pass_rate(load_policy(agent_model_dir, hacked), tokenizer) == candidate


def clustered_runs(
    rng: np.random.Generator, runs: int, broken_share: float
) -> list[tuple[float, float]]:
    """(malformed calls, calls) of runs where calls fail together: a broken run (a model that
    has lost a tool's name) gets most of its calls wrong, a clean one few."""
    calls = rng.integers(1, 7, size=runs)
    broken = rng.random(runs) < broken_share
    malformed = np.where(broken, rng.binomial(calls, 0.8), rng.binomial(calls, 0.03))
    return [(float(m), float(c)) for m, c in zip(malformed, calls, strict=True)]


def malformed_share(broken_share: float) -> float:
    """The share of malformed calls in `clustered_runs` (calls do not depend on brokenness)."""
    return broken_share * 0.8 + (1 - broken_share) * 0.03


def test_intervals_over_runs_keep_their_level_when_a_runs_calls_fail_together() -> None:
    rng = np.random.default_rng(5)
    trials, runs = 300, 400
    false_alarms = per_call_false_alarms = 0
    for _ in range(trials):
        ours, theirs = clustered_runs(rng, runs, 0.1), clustered_runs(rng, runs, 0.1)
        versus = compare_over_runs(ours, theirs)
        assert versus is not None and versus.ci_low is not None and versus.ci_high is not None
        false_alarms += versus.ci_low > 0 or versus.ci_high < 0
        # What counting every call as an independent coin flip would conclude.
        p, n = sum(m for m, _ in ours) / sum(c for _, c in ours), sum(c for _, c in ours)
        q, k = sum(m for m, _ in theirs) / sum(c for _, c in theirs), sum(c for _, c in theirs)
        z = (p - q) / ((p * (1 - p) / n + q * (1 - q) / k) ** 0.5)
        per_call_false_alarms += abs(z) > scipy.stats.norm.ppf(0.975)
    # A/A: the 95% interval excludes 0 about 5% of the time (binomial sd 1.3 pp over 300).
    assert false_alarms / trials < 0.09
    assert per_call_false_alarms / trials > 0.15

    covered = 0
    truth = malformed_share(0.15) - malformed_share(0.1)
    for _ in range(trials):
        versus = compare_over_runs(clustered_runs(rng, runs, 0.15), clustered_runs(rng, runs, 0.1))
        assert versus is not None and versus.ci_low is not None and versus.ci_high is not None
        covered += versus.ci_low <= truth <= versus.ci_high
    assert covered / trials > 0.91
