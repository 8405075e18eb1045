"""The shipped base models: what their recorded recipe built, checked before they are used."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from sandbox.agent_runs import run_agents
from sandbox.agent_tasks import agent_tasks
from sandbox.bases import (
    DEFAULT_BASE,
    SHIPPED_BASES,
    SUMS_FILE,
    BaseModelError,
    install_base,
    shipped_base_dir,
    verify_base,
)
from sandbox.bootstrap import (
    RECIPES,
    BootstrapConfig,
    build_corpus,
    encode_corpus,
    evaluate,
    torch_threads,
)
from sandbox.tasks import heldout_tasks


def recorded(name: str) -> tuple[dict, BootstrapConfig]:
    record = json.loads((shipped_base_dir(name) / "bootstrap.json").read_text())
    return record, BootstrapConfig(**record["config"])


@pytest.mark.parametrize("name", SHIPPED_BASES)
def test_a_shipped_base_is_its_recipe_recorded_with_checksums(name: str) -> None:
    identity = verify_base(shipped_base_dir(name), name)
    assert len(identity.checksum) == 64
    record, config = recorded(name)
    # The code's recipe is the one the shipped files were built by: a recipe changed without
    # a rebuild fails here.
    assert asdict(config) == asdict(RECIPES[name])
    assert record["seed"] == config.seed
    assert record["train_steps"] >= config.train_steps
    assert {"processor", "vector_extensions", "torch"} <= record["built_on"].keys()
    listed = [line.split("  ")[1] for line in (identity.path / SUMS_FILE).read_text().splitlines()]
    assert {"model.safetensors", "config.json", "tokenizer.json", "bootstrap.json"} <= set(listed)
    weights = (identity.path / "model.safetensors").stat().st_size
    assert weights < 4_000_000  # small enough to ship in the repository


@pytest.mark.parametrize("name", SHIPPED_BASES)
def test_a_shipped_base_reproduces_its_recorded_loss_and_held_out_pass_rate(name: str) -> None:
    record, config = recorded(name)
    model_dir = shipped_base_dir(name)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    with torch_threads(1):
        tasks = heldout_tasks(config.seed, config.eval_tasks)
        greedy = evaluate(model, tokenizer, tasks, config, sample=False)
        input_ids, attention_mask, labels = encode_corpus(
            tokenizer, build_corpus(replace(config, corpus_examples=512))
        )
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        ).item()
    # Greedy decoding of the same weights: the figure it was shipped with, up to a few answers
    # a processor that rounds differently may flip.
    assert greedy.pass_rate == pytest.approx(record["heldout_pass_greedy"], abs=0.03)
    # The mean training loss of its last 100 steps, on corpus examples it trained on: a little
    # lower at the end of training than over those steps (0.78-0.82 of it when shipped), never
    # higher. The other shipped base's weights read 1.43 of this one's.
    assert 0.6 * record["final_loss"] <= loss <= 1.05 * record["final_loss"]


@pytest.mark.slow
def test_the_default_base_solves_its_recorded_share_of_validation_agent_runs() -> None:
    record, config = recorded(DEFAULT_BASE)
    model_dir = shipped_base_dir(DEFAULT_BASE)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    with torch_threads(1):
        runs = run_agents(
            model,
            tokenizer,
            agent_tasks(config.seed + 1, config.check_runs, "train"),
            seed=config.seed,
        )
    solved = sum(run.solved for run in runs) / len(runs)
    assert record["agent_solved_check"] >= config.min_agent_solved
    assert solved == pytest.approx(record["agent_solved_check"], abs=0.1)


def test_a_changed_file_is_refused_with_the_file_named(tmp_path: Path) -> None:
    base = install_base(DEFAULT_BASE, tmp_path / "base")
    assert base.checksum == verify_base(shipped_base_dir(DEFAULT_BASE)).checksum
    assert install_base(DEFAULT_BASE, tmp_path / "base") == base  # already there: kept
    weights = tmp_path / "base" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    with pytest.raises(BaseModelError, match=r"model\.safetensors does not match its checksum"):
        verify_base(tmp_path / "base")
    with pytest.raises(BaseModelError, match=r"model\.safetensors"):
        install_base(DEFAULT_BASE, tmp_path / "base")
    shown = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "model", "show", str(tmp_path / "base")],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 1
    assert "does not match its checksum" in shown.stderr and "Traceback" not in shown.stderr


def test_a_missing_or_unlisted_file_is_refused(tmp_path: Path) -> None:
    base = install_base(DEFAULT_BASE, tmp_path / "base").path
    (base / "tokenizer.json").unlink()
    with pytest.raises(BaseModelError, match=r"incomplete: tokenizer\.json is missing"):
        verify_base(base)
    other = install_base(DEFAULT_BASE, tmp_path / "other").path
    (other / "extra.bin").write_bytes(b"x")
    with pytest.raises(BaseModelError, match=r"extra\.bin not covered"):
        verify_base(other)


def test_a_data_dir_holding_another_base_is_not_overwritten(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    shutil.copytree(shipped_base_dir(DEFAULT_BASE), mine)
    (mine / SUMS_FILE).unlink()
    # A model from elsewhere carries no checksums: used as it is, never vouched for.
    assert verify_base(mine).checksum == ""
    with pytest.raises(BaseModelError, match="holds another base"):
        install_base(DEFAULT_BASE, mine)
    assert not (mine / SUMS_FILE).exists()


def test_show_prints_each_shipped_base_identity() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "model", "show", "--shipped"],
        capture_output=True,
        text=True,
        check=True,
    )
    for name in SHIPPED_BASES:
        checksum = verify_base(shipped_base_dir(name)).checksum
        assert f"{name} sha256:{checksum[:12]}" in shown.stdout
        assert checksum in shown.stdout
