"""The evaluation gate's measures: how far a candidate moved from production, on one-turn
answers and on agent turns, and what it takes to pass."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from sandbox.agent_tasks import agent_tasks
from sandbox.task_family import EVAL_SEED, reference_turns
from trainer.evaluate import gate


def test_the_agent_turns_are_tool_calls_and_final_answers_with_the_tools_declared(
    tiny_model_dir: Path,
) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    turns = reference_turns(tokenizer, agent_tasks(EVAL_SEED, 4, "heldout"))

    assert len(turns) == 3 * 4  # a read, an edit and the final answer per run
    answers = [tokenizer.decode(answer) for _, answer in turns]
    assert all(answer.endswith(tokenizer.eos_token) for answer in answers)
    assert [a.split('"name": ')[1][:11] for a in answers[:2]] == ['"read_file"', '"edit_file"']
    assert answers[2].startswith(("Done.", "完成了。"))
    assert all("<tools>" in tokenizer.decode(prompt) for prompt, _ in turns)


def test_a_candidate_that_drifted_on_agent_turns_alone_is_rejected() -> None:
    moved = gate("task_family", 0.5, 0.6, 0.1, 0.9, max_regression=0.05, max_kl=0.5)
    steady = gate("task_family", 0.5, 0.6, 0.1, 0.2, max_regression=0.05, max_kl=0.5)
    unmeasured = gate("logged_traffic", 0.5, 0.6, 0.1, None, max_regression=0.05, max_kl=0.5)

    assert not moved.passed and moved.reason is not None and "agent turns" in moved.reason
    assert steady.passed and unmeasured.passed
    assert steady.as_dict()["agent_kl_to_production"] == 0.2
