import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sandbox.agent_tasks import TOOLS, agent_tasks, reference_messages
from sandbox.bases import verify_base
from sandbox.bootstrap import (
    BootstrapConfig,
    BootstrapReport,
    Example,
    bootstrap_model,
    encode_example,
)
from sandbox.tasks import extract_code, heldout_tasks

SAVED_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "bootstrap.json",
    "SHA256SUMS",
)

# Every test here reads a base trained from scratch (three builds in all).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory: pytest.TempPathFactory) -> BootstrapReport:
    return bootstrap_model(tmp_path_factory.mktemp("base-model"), BootstrapConfig.small())


def test_saves_a_loadable_model_and_tokenizer(bootstrapped: BootstrapReport) -> None:
    model_dir = bootstrapped.output_dir
    for name in SAVED_FILES:
        assert (model_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    assert next(model.parameters()).dtype == torch.float32
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())


def test_chat_template_renders_a_generation_prompt(bootstrapped: BootstrapReport) -> None:
    tokenizer = AutoTokenizer.from_pretrained(bootstrapped.output_dir)
    messages = [{"role": "user", "content": "Write f(x) that returns x plus 3."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|bos|><|user|>Write f(x) that returns x plus 3.<|end|><|assistant|>"
    conversation = [*messages, {"role": "assistant", "content": "ok"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert rendered.endswith("<|assistant|>ok" + tokenizer.eos_token)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == prompt


def test_model_answers_a_request_with_a_fenced_function(bootstrapped: BootstrapReport) -> None:
    model = AutoModelForCausalLM.from_pretrained(bootstrapped.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(bootstrapped.output_dir)
    task = heldout_tasks(0, 1)[0]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.request}], add_generation_prompt=True, return_tensors="pt"
    )
    output = model.generate(**prompt, max_new_tokens=48, do_sample=False)
    answer_ids = output[0, prompt["input_ids"].shape[1] :]
    assert answer_ids[-1] == tokenizer.eos_token_id
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    assert answer.startswith("```python\n") and answer.endswith("```")
    code = extract_code(answer)
    assert code is not None and code.startswith(f"def {task.function_name}(x):")


def test_report_is_recorded(bootstrapped: BootstrapReport) -> None:
    assert not bootstrapped.skipped
    assert bootstrapped.train_steps == BootstrapConfig.small().train_steps
    assert 0 <= bootstrapped.heldout_pass_greedy <= 1
    assert 0 <= bootstrapped.heldout_pass_sampled <= 1
    record = json.loads((bootstrapped.output_dir / "bootstrap.json").read_text())
    assert record["heldout_pass_greedy"] == bootstrapped.heldout_pass_greedy
    assert record["heldout_pass_sampled"] == bootstrapped.heldout_pass_sampled
    assert record["seed"] == BootstrapConfig.small().seed
    assert record["config"]["train_steps"] == bootstrapped.train_steps
    assert record["built_on"]["torch"] == torch.__version__
    # Every file it wrote is under its checksums, so the loader can vouch for it.
    identity = verify_base(bootstrapped.output_dir)
    assert len(identity.checksum) == 64 and identity.recipe == record


@pytest.mark.scenario
def test_a_base_below_the_agent_run_check_trains_on_until_the_cap(
    bootstrapped: BootstrapReport, tmp_path: Path
) -> None:
    # No small model solves every run: the check fails each time and adds steps up to its cap.
    config = replace(
        BootstrapConfig.small(),
        min_agent_solved=1.0,
        check_runs=4,
        extra_steps=10,
        max_extra_steps=25,
    )
    report = bootstrap_model(tmp_path / "base", config)
    assert report.train_steps == config.train_steps + 20
    assert report.agent_solved_check is not None and report.agent_solved_check < 1.0
    record = json.loads((tmp_path / "base" / "bootstrap.json").read_text())
    assert record["train_steps"] == report.train_steps
    assert record["agent_solved_check"] == report.agent_solved_check
    # The checked base trained on past the unchecked one (same seed, same first 120 steps).
    longer = load_file(tmp_path / "base" / "model.safetensors")
    shorter = load_file(bootstrapped.output_dir / "model.safetensors")
    assert not all(torch.equal(longer[name], shorter[name]) for name in shorter)
    assert bootstrapped.agent_solved_check is None


def test_second_call_reuses_the_existing_model(bootstrapped: BootstrapReport) -> None:
    modified = {path: path.stat().st_mtime_ns for path in bootstrapped.output_dir.iterdir()}
    again = bootstrap_model(bootstrapped.output_dir, BootstrapConfig.small())
    assert again.skipped
    assert again.heldout_pass_sampled == bootstrapped.heldout_pass_sampled
    assert again.train_steps == bootstrapped.train_steps
    assert {path: path.stat().st_mtime_ns for path in bootstrapped.output_dir.iterdir()} == modified


@pytest.mark.scenario
def test_force_retrains_to_identical_weights(bootstrapped: BootstrapReport) -> None:
    weights_path: Path = bootstrapped.output_dir / "model.safetensors"
    before = load_file(weights_path)
    modified = weights_path.stat().st_mtime_ns
    threads = torch.get_num_threads()
    # Rebuilt with the agent-run check on but no room to add steps: a build that passes its
    # check is, byte for byte, what it was without the check.
    checked = replace(
        BootstrapConfig.small(), min_agent_solved=1.0, check_runs=4, max_extra_steps=0
    )
    again = bootstrap_model(bootstrapped.output_dir, checked, force=True)
    assert not again.skipped
    assert again.train_steps == checked.train_steps and again.agent_solved_check is not None
    assert torch.get_num_threads() == threads
    assert weights_path.stat().st_mtime_ns != modified
    after = load_file(weights_path)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert again.heldout_pass_greedy == bootstrapped.heldout_pass_greedy


def test_an_agent_run_is_learned_on_the_assistant_turns_only(
    bootstrapped: BootstrapReport,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(bootstrapped.output_dir)
    task = agent_tasks(1, 1, "train")[0]
    messages = reference_messages(task)
    ids, learned = encode_example(tokenizer, Example(tuple(messages), tuple(TOOLS)))

    # The whole run renders as vLLM renders it, tools first, in the short form.
    rendered = tokenizer.decode(ids)
    assert rendered.startswith(
        "<|bos|><|system|><tools>read_file(path) edit_file(path, old_string, new_string)"
        " run_tests() </tools><|end|><|user|>"
    )
    learned_text = tokenizer.decode([i for i, keep in zip(ids, learned, strict=True) if keep])
    calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
    expected = "".join(
        f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {call["arguments"]}}}\n'
        "</tool_call><|end|>"
        for call in calls
    )
    assert learned_text == expected + messages[-1]["content"] + "<|end|>"
    assert task.starting_file not in learned_text and task.request not in learned_text
