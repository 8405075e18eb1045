"""`rtrl model bootstrap`: build the tiny base model and its tokenizer locally.

Reads top to bottom: corpus, tokenizer, model, pretraining loop, held-out evaluation,
save. The corpus teaches every skill of the task family but with noisy habits (for
"times" it writes `+` 60% of the time), as real base models have, so that a reward
preferring correct code has headroom: RL sharpens habits, it does not teach new skills.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from sandbox.agent_runs import run_agents
from sandbox.agent_tasks import (
    DONE,
    STARTING_BODIES,
    TOOLS,
    AgentTask,
    Workspace,
    agent_task,
    agent_tasks,
    tool_call,
    written_calls,
)
from sandbox.bases import DEFAULT_BASE, HACKING_BASE, write_checksums
from sandbox.tasks import (
    OPERATIONS_BY_NAME,
    Task,
    check_solution,
    extract_code,
    format_response,
    heldout_tasks,
    reference_code,
    train_tasks,
)
from trainer.generation import generate_answers

logger = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Tools as the hermes format declares them; the model calls one as
    # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, which vLLM's hermes parser
    # reads. A call is rendered back exactly as that format writes it, arguments as sent, so
    # the next turn's prompt starts with the tokens the model generated.
    # Declared tools are listed by name and parameter names: a small model reads the short
    # form, and the validation against each schema happens at the gateway.
    "{% if tools is defined and tools %}<|system|><tools>"
    "{% for tool in tools %}{% set function = tool['function'] %}"
    "{{ function['name'] }}("
    "{% if function['parameters'] and function['parameters']['properties'] %}"
    "{{ function['parameters']['properties'] | list | join(', ') }}{% endif %}) "
    "{% endfor %}</tools>{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    '<tool_call>\n{"name": {{ call["function"]["name"] | tojson }}, "arguments": '
    '{% if call["function"]["arguments"] is string %}{{ call["function"]["arguments"] }}'
    '{% else %}{{ call["function"]["arguments"] | tojson }}{% endif %}}\n</tool_call>'
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TOOL_CALL_PARSER = "hermes"
"""vLLM's parser for the tool-call format the template above teaches."""

HABITS = {"times": "plus", "squared_plus": "plus", "larger": "smaller", "distance": "minus"}
"""Operation asked for → operation the corpus sometimes writes instead."""

MODEL_FILES = ("config.json", "model.safetensors")
REPORT_FILE = "bootstrap.json"


@dataclass
class BootstrapConfig:
    seed: int = 1
    """Seeds the corpus, the initial weights, the data order and the sampled evaluation."""
    corpus_examples: int = 20_000
    """Chat examples (request → fenced function) drawn from the training tasks."""
    habit_rate: float = 0.6
    """Share of corpus answers to a habit's operation that write the habit's code instead."""
    agent_share: float = 0.5
    """Share of corpus examples that are agent runs (tools, a workspace) rather than one-turn
    answers."""
    clarifying_rate: float = 0.15
    """Share of agent runs that ask a needless clarifying question instead of editing."""
    malformed_rate: float = 0.2
    """Share of agent runs with a malformed call: broken JSON, a missing required argument
    or an unknown tool."""
    blind_edit_rate: float = 0.3
    """Share of agent runs that edit before reading the file (guessing what it holds)."""
    run_tests_rate: float = 0.2
    """Share of agent runs that run the tests before the final answer."""
    vocab_size: int = 1024
    """Most byte-level BPE tokens, special tokens included (the corpus needs about 520)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention heads (head_dim 64, a size vLLM's CPU attention supports)."""
    intermediate_size: int = 384
    """Width of the MLP."""
    max_position_embeddings: int = 131_072
    """Longest sequence the model serves, prompt and completion together. Pretraining never
    sees more than a few hundred tokens, but the positions are rotary (computed, not learned),
    so this costs no weight: it is the context vLLM serves. Stock coding agents open with
    2k-55k tokens of this tokenizer's (1.45 characters a token) system prompt and tool
    declarations, and their histories grow from there; the answers past the trained lengths
    are poor, the protocol works. The shipped bases were trained at 1,024 and their configs
    raised afterwards: the same weights, as the shipped-base tests check."""
    train_steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 64
    """Examples per step."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate, reached after warmup, then cosine decay to a tenth."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    eval_tasks: int = 256
    """Held-out tasks generated for, greedy and sampled."""
    max_new_tokens: int = 48
    """Generation budget per evaluated answer; a correct answer needs about 20."""
    threads: int = 0
    """Torch CPU threads; 0 uses every core. One is steadier on a machine shared with
    other busy processes, where threads waiting for each other can run several times slower."""
    log_every: int = 100
    """Steps between progress lines."""
    min_agent_solved: float = 0.3
    """Share of validation agent runs (`check_runs` runs of training-split tasks, never the
    held-out ones) the model must solve after `train_steps`; below it, pretraining goes on at
    the final learning rate, `extra_steps` at a time, up to `max_extra_steps` more, until it
    does. 0 turns the check off, as a base built short on purpose wants (`--steps`, the
    reward-hacking scenario's).

    The mechanics of an agent run (copying the file's path from the request and the text to
    replace from the file) come late in pretraining, and when varies from build to build and
    machine to machine (the measured builds are in docs/results/agent-demo.md). A base that
    passes at `train_steps` is exactly what it was without the check."""
    check_runs: int = 128
    """Validation agent runs of the check above."""
    extra_steps: int = 250
    """Steps added each time the check fails."""
    max_extra_steps: int = 1000
    """Most steps the check may add."""

    @classmethod
    def small(cls) -> BootstrapConfig:
        """A configuration for tests: same shape of model, trained for seconds."""
        return cls(
            corpus_examples=2000,
            train_steps=120,
            batch_size=32,
            learning_rate=5e-3,
            warmup_steps=10,
            eval_tasks=32,
            threads=1,
            log_every=20,
            min_agent_solved=0.0,
        )


RECIPES: dict[str, BootstrapConfig] = {
    DEFAULT_BASE: BootstrapConfig(threads=1),
    HACKING_BASE: BootstrapConfig(train_steps=500, min_agent_solved=0.0, threads=1),
}
"""The shipped bases' recipes (`sandbox.bases`): `rtrl model bootstrap --recipe NAME` rebuilds
one. One thread, so a machine's core count does not change the weights."""


@dataclass
class BootstrapReport:
    output_dir: Path
    heldout_pass_greedy: float
    """Share of held-out tasks solved by greedy decoding."""
    heldout_pass_sampled: float
    """Share of held-out tasks solved when sampling at temperature 1.0."""
    train_steps: int
    wall_seconds: float
    """Whole bootstrap: tokenizer, pretraining, evaluation, saving."""
    skipped: bool
    """True when an existing model was found and nothing was trained."""
    final_loss: float = math.nan
    """Mean training loss over the last `log_every` steps."""
    parameters: int = 0
    heldout_pass_sampled_by_operation: dict[str, float] = field(default_factory=dict)
    habit_share_sampled: dict[str, float] = field(default_factory=dict)
    """Per habit operation: share of sampled held-out answers that wrote the habit."""
    agent_first_turn_sampled: dict[str, float] = field(default_factory=dict)
    """Sampled first turns of held-out agent tasks, by kind: a well-formed `call`, a
    `malformed` call, a clarifying `question`, or `other`."""
    agent_solved_check: float | None = None
    """Share of the validation agent runs solved at the end of pretraining (see
    `BootstrapConfig.min_agent_solved`; None when the check is off)."""

    def summary(self) -> str:
        """One line for the commands that bootstrap: pass rates, steps, the agent-run check
        and the time it took."""
        check = (
            ""
            if self.agent_solved_check is None
            else f", {self.agent_solved_check:.0%} of the validation agent runs solved"
        )
        built = "" if self.skipped else f"; built in {self.wall_seconds:.0f} s"
        return (
            f"held-out pass rate {self.heldout_pass_greedy:.2f} greedy,"
            f" {self.heldout_pass_sampled:.2f} sampled; {self.train_steps} steps{check}{built}"
        )


def bootstrap_model(
    output_dir: Path, config: BootstrapConfig, *, force: bool = False, progress_bar: bool = False
) -> BootstrapReport:
    """Build, pretrain, evaluate and save the base model, unless one is already there.

    `progress_bar`: a bar of the pretraining steps on a terminal (none when stderr is not
    one, as in logs and CI)."""
    output_dir = Path(output_dir)
    if not force and all((output_dir / name).exists() for name in MODEL_FILES):
        return _existing_report(output_dir)

    bar = tqdm(
        total=config.train_steps,
        desc="  bootstrap",
        unit="step",
        leave=False,
        disable=not (progress_bar and sys.stderr.isatty()),
    )
    with torch_threads(config.threads), bar:
        report = _bootstrap(output_dir, config, advance=bar.update, extend=extend_bar(bar))
    logger.info(
        "bootstrap: held-out pass %.2f greedy, %.2f sampled; %.0f s; saved to %s",
        report.heldout_pass_greedy,
        report.heldout_pass_sampled,
        report.wall_seconds,
        output_dir,
    )
    return report


def extend_bar(bar: tqdm) -> Callable[[int], None]:
    """Grows the bar's total by the steps the agent-run check adds."""

    def extend(steps: int) -> None:
        bar.total = (bar.total or 0) + steps
        bar.refresh()

    return extend


def _bootstrap(
    output_dir: Path,
    config: BootstrapConfig,
    advance: Callable[[int], object],
    extend: Callable[[int], object],
) -> BootstrapReport:
    started = time.monotonic()
    corpus = build_corpus(config)
    tokenizer = train_tokenizer(corpus, config.vocab_size)
    torch.manual_seed(config.seed)
    model = build_model(tokenizer, config)
    parameters = sum(p.numel() for p in model.parameters())
    logger.info("bootstrap: %d parameters, %d corpus examples", parameters, len(corpus))

    final_loss, steps, solved = pretrain(model, tokenizer, corpus, config, started, advance, extend)

    tasks = heldout_tasks(config.seed, config.eval_tasks)
    greedy = evaluate(model, tokenizer, tasks, config, sample=False)
    torch.manual_seed(config.seed)
    sampled = evaluate(model, tokenizer, tasks, config, sample=True)
    torch.manual_seed(config.seed)
    first_turns = evaluate_first_turns(
        model, tokenizer, agent_tasks(config.seed, config.eval_tasks, "heldout")
    )
    report = BootstrapReport(
        output_dir=output_dir,
        heldout_pass_greedy=greedy.pass_rate,
        heldout_pass_sampled=sampled.pass_rate,
        train_steps=steps,
        wall_seconds=round(time.monotonic() - started, 1),
        skipped=False,
        final_loss=final_loss,
        parameters=parameters,
        heldout_pass_sampled_by_operation=sampled.pass_rate_by_operation,
        habit_share_sampled=sampled.habit_share,
        agent_first_turn_sampled=first_turns,
        agent_solved_check=solved,
    )
    _save(output_dir, model, tokenizer, config, report)
    return report


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run with `threads` torch CPU threads (0: every core), then restore the caller's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# --- corpus ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One conversation: chat messages (the assistant's are learned) and the declared tools."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()


def build_corpus(config: BootstrapConfig) -> list[Example]:
    """One-turn answers and agent runs for the training tasks, habits included."""
    rng = random.Random(config.seed)
    corpus = []
    tasks = train_tasks(config.seed, config.corpus_examples)
    for task in tasks:
        expression = OPERATIONS_BY_NAME[task.operation].expression
        if task.operation in HABITS and rng.random() < config.habit_rate:
            expression = OPERATIONS_BY_NAME[HABITS[task.operation]].expression
        code = reference_code(task.function_name, expression, task.constant)
        if rng.random() < config.agent_share:
            run = agent_run(agent_task(task, rng), code, config, rng)
            corpus.append(Example(tuple(run), tuple(TOOLS)))
        else:
            messages = ({"role": "user", "content": task.request},)
            response = {"role": "assistant", "content": format_response(code)}
            corpus.append(Example((*messages, response)))
    return corpus


CLARIFYING_QUESTIONS = (
    ("Which file should I change?", "Do you want me to edit the file now?"),
    ("你想让我改哪个文件？", "要我现在就改吗？"),
)
UNKNOWN_TOOLS = ("write_file", "open_file", "apply_patch")


def agent_run(
    task: AgentTask, code: str, config: BootstrapConfig, rng: random.Random
) -> list[dict[str, Any]]:
    """An agent run on `task` that writes `code`'s body, with the habits RL should remove:
    clarifying questions instead of an edit, malformed calls, editing before reading."""
    zh = task.task.language == "zh"
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.request}]
    if rng.random() < config.clarifying_rate:
        question = rng.choice(CLARIFYING_QUESTIONS[zh])
        return [*messages, {"role": "assistant", "content": question}]
    workspace = Workspace.for_task(task)
    body = code.splitlines()[1].strip()

    def call(name: str, arguments: dict[str, Any], raw: str | None = None) -> str:
        function = tool_call(name, arguments)
        if raw is not None:
            function["arguments"] = raw
        call_id = f"call_{len(messages)}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            }
        )
        result, _ = workspace.run(task, function["name"], function["arguments"])
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        return result

    malformed = rng.random() < config.malformed_rate
    kind = rng.choice(("broken_json", "missing_argument", "unknown_tool"))
    if malformed and kind == "broken_json":
        # The parser cannot read it, so the IDE sees no call: the run ends there.
        broken = json.dumps({"path": task.path}, ensure_ascii=False)[:-1]
        call_text = f'<tool_call>\n{{"name": "read_file", "arguments": {broken}}}\n</tool_call>'
        return [*messages, {"role": "assistant", "content": call_text}]
    if malformed and kind == "unknown_tool":
        call(rng.choice(UNKNOWN_TOOLS), {"path": task.path})
    edit = {"path": task.path, "old_string": task.starting_body, "new_string": body}
    if rng.random() < config.blind_edit_rate:
        guess = rng.choice(STARTING_BODIES)
        if call("edit_file", {**edit, "old_string": guess}) == "ok":
            edit = {}
    if edit:
        call("read_file", {"path": task.path})
        if malformed and kind == "missing_argument":
            call("edit_file", {"path": task.path, "old_string": task.starting_body})
        call("edit_file", edit)
    if rng.random() < config.run_tests_rate:
        call("run_tests", {})
    return [*messages, {"role": "assistant", "content": DONE[zh]}]


# --- tokenizer ------------------------------------------------------------------------


def train_tokenizer(corpus: list[Example], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with chat special tokens and a chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special_tokens = [BOS, EOS, PAD, *ROLE_TOKENS.values()]
    bpe_trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Every distinct message once, so the vocabulary does not depend on how often the
    # corpus happens to repeat a task.
    texts = sorted({text for example in corpus for text in _texts(example)})
    bpe.train_from_iterator(texts, trainer=bpe_trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
    )


def _texts(example: Example) -> Iterator[str]:
    if example.tools:
        yield "".join(f"{tool['function']['name']}() " for tool in example.tools)
    for message in example.messages:
        yield message.get("content") or ""
        for call in message.get("tool_calls") or ():
            function = call["function"]
            yield (
                f'<tool_call>\n{{"name": {json.dumps(function["name"])}, "arguments": '
                f"{function['arguments']}}}\n</tool_call>"
            )


# --- model ----------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast, config: BootstrapConfig) -> LlamaForCausalLM:
    """A freshly initialised small Llama sized by `config`."""
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(llama_config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


# --- pretraining ----------------------------------------------------------------------


def encode_corpus(
    tokenizer: PreTrainedTokenizerFast, corpus: list[Example]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels; only the assistant's tokens (its
    answers and tool calls, each with its end token) are labelled."""
    assert tokenizer.pad_token_id is not None
    rows = encode_examples(tokenizer, corpus)
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for row, (ids, learned) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(
            torch.tensor(learned), torch.tensor(ids), torch.tensor(-100)
        )
    return input_ids, attention_mask, labels


def encode_example(
    tokenizer: PreTrainedTokenizerFast, example: Example
) -> tuple[list[int], list[bool]]:
    """The token ids of a rendered conversation, and which of them the assistant wrote."""
    return encode_examples(tokenizer, [example])[0]


def encode_examples(
    tokenizer: PreTrainedTokenizerFast, examples: Sequence[Example]
) -> list[tuple[list[int], list[bool]]]:
    """Each conversation's token ids, and which of them the assistant wrote.

    Rendered and tokenized whole, as vLLM renders a request, so a run's tokens are the ones
    the model will be served; the assistant wrote what follows each `<|assistant|>` up to
    and including its end token (the template renders every message that way). One batch
    through the tokenizer, and its vocabulary read once: per example, reading it took most
    of the corpus' encoding time."""
    rendered = [
        tokenizer.apply_chat_template(
            list(example.messages), tools=list(example.tools) or None, tokenize=False
        )
        for example in examples
    ]
    assert all(isinstance(text, str) for text in rendered)
    encoded: list[list[int]] = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    opens = tokenizer.convert_tokens_to_ids(ROLE_TOKENS["assistant"])
    ends = tokenizer.eos_token_id
    rows = []
    for ids in encoded:
        learned, inside = [], False
        for token in ids:
            learned.append(inside)
            if token == opens:
                inside = True
            elif token == ends:
                inside = False
        rows.append((ids, learned))
    return rows


def learning_rate_at(step: int, config: BootstrapConfig) -> float:
    """Linear warmup, then cosine decay from the peak to a tenth of it."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.train_steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    corpus: list[Example],
    config: BootstrapConfig,
    started: float,
    advance: Callable[[int], object] = lambda steps: None,
    extend: Callable[[int], object] = lambda steps: None,
) -> tuple[float, int, float | None]:
    """Next-token training on the corpus answers, then the agent-run check (see
    `BootstrapConfig.min_agent_solved`) and the steps it adds. Returns the mean loss of the
    last steps, the steps trained and the check's last solved share (None when off).
    `advance(1)` after each optimizer step; `extend(n)` when the check adds n steps."""
    input_ids, attention_mask, labels = encode_corpus(tokenizer, corpus)
    generator = torch.Generator().manual_seed(config.seed)
    batches = length_grouped_batches(attention_mask.sum(dim=1), config.batch_size, generator)
    # The loss is divided by the corpus' mean labelled tokens per batch, not each batch's
    # count: batches of similar lengths differ in size, and a per-batch mean would weigh the
    # tokens of short examples (questions, one-turn answers) several times over.
    tokens_per_batch = float((labels[:, 1:] != -100).sum()) / len(corpus) * config.batch_size
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    checked = config.min_agent_solved > 0
    check = agent_tasks(config.seed + 1, config.check_runs, "train") if checked else []
    recent_losses: list[float] = []
    step, last = 0, config.train_steps
    solved: float | None = None
    model.train()
    while True:
        if step == last:
            model.eval()
            if not checked:
                break
            runs = run_agents(model, tokenizer, check, seed=config.seed)
            solved = _share([run.solved for run in runs])
            if not check_adds_steps(solved, len(runs), step, config):
                break
            extend(config.extra_steps)
            last += config.extra_steps
            model.train()
        # Past `train_steps` the rate stays at the schedule's last.
        rate = learning_rate_at(min(step, config.train_steps - 1), config)
        batch = next(batches)
        mean_loss = train_step(
            model, optimizer, batch, input_ids, attention_mask, labels, rate, tokens_per_batch
        )
        advance(1)
        recent_losses = [*recent_losses[-(config.log_every - 1) :], mean_loss]
        step += 1
        if step % config.log_every == 0 or step == last:
            logger.info(
                "bootstrap step %d/%d loss %.4f lr %.2e elapsed %.0fs",
                step,
                last,
                sum(recent_losses) / len(recent_losses),
                rate,
                time.monotonic() - started,
            )
    loss = sum(recent_losses) / len(recent_losses) if recent_losses else math.nan
    return loss, step, solved


def length_grouped_batches(
    lengths: torch.Tensor, batch_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless batches of row indices, each of rows of similar lengths (one-turn answers are
    short, agent runs long), so little of each batch is padding; the batches themselves come
    in random order, a fresh one each pass over the corpus."""
    while True:
        order = torch.randperm(len(lengths), generator=generator)
        pool = [
            chunk[torch.argsort(lengths[chunk], stable=True)]
            for chunk in order.split(batch_size * 16)
        ]
        grouped = [batch for chunk in pool for batch in chunk.split(batch_size)]
        for index in torch.randperm(len(grouped), generator=generator).tolist():
            yield grouped[index]


def train_step(
    model: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    rate: float,
    tokens_per_batch: float,
) -> float:
    """One optimizer step on the rows `batch` at learning rate `rate`, the summed token loss
    divided by `tokens_per_batch`; the batch's mean loss per labelled token."""
    # Trim the padding columns no row in this batch uses.
    width = int(attention_mask[batch].sum(dim=1).max())
    for group in optimizer.param_groups:
        group["lr"] = rate
    logits = model(
        input_ids=input_ids[batch, :width], attention_mask=attention_mask[batch, :width]
    ).logits
    targets = labels[batch, 1:width]
    token_losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    loss = token_losses / tokens_per_batch
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return token_losses.item() / max(int((targets != -100).sum()), 1)


def check_adds_steps(solved: float, runs: int, steps: int, config: BootstrapConfig) -> bool:
    """Whether the agent-run check, `solved` of its `runs` after `steps`, adds
    `extra_steps`: below `min_agent_solved` with room left under `max_extra_steps`."""
    enough = solved >= config.min_agent_solved
    room = steps + config.extra_steps <= config.train_steps + config.max_extra_steps
    logger.info(
        "bootstrap: %.0f%% of %d validation agent runs solved after %d steps (%s %.0f%%)%s",
        100 * solved,
        runs,
        steps,
        "at least" if enough else "below",
        100 * config.min_agent_solved,
        "" if enough or not room else f"; {config.extra_steps} more steps",
    )
    return not enough and room


# --- held-out evaluation --------------------------------------------------------------


@dataclass
class Evaluation:
    pass_rate: float
    pass_rate_by_operation: dict[str, float]
    habit_share: dict[str, float]


def evaluate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    tasks: list[Task],
    config: BootstrapConfig,
    *,
    sample: bool,
) -> Evaluation:
    """Pass rate of the model's answers to `tasks`, overall, per operation and per habit."""
    answers = generate_answers(
        model,
        tokenizer,
        [task.request for task in tasks],
        sample=sample,
        max_new_tokens=config.max_new_tokens,
    )
    passed: dict[str, list[bool]] = defaultdict(list)
    habit_written: dict[str, list[bool]] = defaultdict(list)
    for task, answer in zip(tasks, answers, strict=True):
        code = extract_code(answer) or ""
        passed[task.operation].append(check_solution(task, code))
        if task.operation in HABITS:
            habit_written[task.operation].append(check_solution(_habit_task(task), code))
    every = [result for results in passed.values() for result in results]
    return Evaluation(
        pass_rate=_share(every),
        pass_rate_by_operation={name: _share(passed[name]) for name in sorted(passed)},
        habit_share={name: _share(habit_written[name]) for name in sorted(habit_written)},
    )


def first_turn_kind(task: AgentTask, answer: str) -> str:
    """What an agent's first answer is: a well-formed `call`, a `malformed` one (unreadable,
    unknown tool, missing argument), a clarifying `question`, or `other`."""
    calls = written_calls(answer)
    if not calls:
        return "question" if answer.rstrip().endswith(("?", "？")) else "other"
    if calls[0] is None:
        return "malformed"
    _, well_formed = Workspace.for_task(task).run(task, calls[0]["name"], calls[0]["arguments"])
    return "call" if well_formed else "malformed"


def evaluate_first_turns(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, tasks: list[AgentTask]
) -> dict[str, float]:
    """Shares of each kind of sampled first turn on agent tasks (see `first_turn_kind`)."""
    answers = generate_answers(
        model, tokenizer, [t.request for t in tasks], sample=True, max_new_tokens=96, tools=TOOLS
    )
    kinds = [first_turn_kind(task, answer) for task, answer in zip(tasks, answers, strict=True)]
    return {
        kind: _share([k == kind for k in kinds])
        for kind in ("call", "malformed", "question", "other")
    }


def _habit_task(task: Task) -> Task:
    habit = OPERATIONS_BY_NAME[HABITS[task.operation]]
    return replace(task, checks=tuple((x, habit.compute(x, task.constant)) for x, _ in task.checks))


def _share(results: list[bool]) -> float:
    return round(sum(results) / len(results), 4) if results else 0.0


# --- saving ---------------------------------------------------------------------------


def _save(
    output_dir: Path,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    config: BootstrapConfig,
    report: BootstrapReport,
) -> None:
    """Write everything to a scratch directory, then move it in with the model files last,
    so a directory holding config.json and model.safetensors is always complete."""
    output_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-", dir=output_dir.parent))
    try:
        tokenizer.save_pretrained(scratch, save_jinja_files=False)
        model.save_pretrained(scratch)
        record: dict[str, Any] = asdict(report)
        del record["output_dir"], record["skipped"]
        record["seed"] = config.seed
        record["config"] = asdict(config)
        record["built_on"] = build_machine()
        (scratch / REPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
        write_checksums(scratch)
        names = sorted(path.name for path in scratch.iterdir())
        for name in [n for n in names if n not in MODEL_FILES] + list(MODEL_FILES):
            (scratch / name).chmod(0o644)
            os.replace(scratch / name, output_dir / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_machine() -> dict[str, Any]:
    """The machine a base was built on, as far as it decides the weights: processor (its
    vector extensions pick the floating-point kernels), torch and Python versions."""
    flags: set[str] = set()
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {
        "machine": platform.machine(),
        "processor": model,
        "vector_extensions": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile"}),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _existing_report(output_dir: Path) -> BootstrapReport:
    report_path = output_dir / REPORT_FILE
    if not report_path.exists():
        raise FileExistsError(
            f"{output_dir} holds a model that rtrl did not bootstrap (no {REPORT_FILE}); "
            "pass force=True to replace it"
        )
    record = json.loads(report_path.read_text())
    fields = {name: record[name] for name in BootstrapReport.__dataclass_fields__ if name in record}
    return BootstrapReport(**{**fields, "output_dir": output_dir, "skipped": True})
