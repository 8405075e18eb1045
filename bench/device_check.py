"""Device check: one full training cycle and a publish on a CUDA GPU, vLLM serving in bf16.

Starts its own embedded Postgres and a vLLM server (bf16 on CUDA) on `--model` (any HF
causal LM directory with a chat template; default: the shipped rtrl-base),
samples `--samples` completions of the task family from it, rewards those that solve their
task, and runs `rtrl train --once`'s cycle on them — in this process, or under
`torchrun --nproc-per-node N` with `--ranks N` — then prints the serving/training drift
metrics against their limits, the timings, and the published checkpoint's first answer.

    python -m bench.device_check [--model DIR] [--samples 256] [--ranks N]

`bench/device_check.sh` installs the GPU build first and says so when there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from sqlalchemy import select
from transformers.utils import logging as transformers_logging

from app.config import Settings, settings_environment
from app.db import session_scope
from app.models import Checkpoint, TrainingRun
from app.processes import free_port
from app.serving.sampling import sample_completions
from app.serving.vllm import VllmServer, vllm_device
from bench._stack import registry_with_base, scratch_stack
from bench.serving import base_model
from bench.trainer import Timeline, record_samples
from rtrl.gates import held_out_for
from trainer.config import train_config_from_env
from trainer.cycle import run_cycle

DRIFT = ("mean_abs", "max_abs", "kl", "capped_share")


def check(args: argparse.Namespace, scratch: Path) -> int:
    model_dir = base_model(args.model)
    stack = scratch_stack(scratch)
    # vLLM and the trainer share the GPU here: leave the trainer most of it.
    server = VllmServer(
        model_dir=model_dir,
        port=free_port(),
        root=scratch / "vllm",
        gpu_memory_utilization=args.vllm_memory,
        max_model_len=args.max_model_len,
    )
    engine = None
    try:
        engine = registry_with_base(stack, model_dir)
        started = time.perf_counter()
        server.start(timeout=900)
        command = server.command()
        dtype = command[command.index("--dtype") + 1]
        print(f"vLLM ({vllm_device()}, {dtype}) started in {time.perf_counter() - started:.1f} s")

        started = time.perf_counter()
        solved = record_samples(engine, server, model_dir, args.samples)
        print(
            f"{args.samples} samples through vLLM in {time.perf_counter() - started:.1f} s; "
            f"{solved:.1%} solve their task (reward 1)"
        )
        settings = Settings(
            data_dir=scratch,
            database_url=stack.postgres.url,
            vllm_urls=[server.url],
            base_model=model_dir,
        )
        overrides = {"min_samples": min(args.samples, 64), "eval_tasks": args.eval_tasks}
        timeline = Timeline()
        if args.ranks > 1:
            run_id = train_under_torchrun(settings, args.ranks, overrides, timeline)
        else:
            config = train_config_from_env(**overrides)
            result = run_cycle(
                settings,
                config,
                engine=engine,
                held_out=held_out_for(config, engine, settings.base_model_path),
                progress=timeline.progress,
            )
            timeline.progress(f"run_cycle returned: {result.status} {result.reason or ''}")
            run_id = result.run_id
        timeline.print()
        with session_scope(engine) as session:
            run = session.get_one(TrainingRun, run_id)
            stats, status, reason = run.stats or {}, run.status, run.reason
            published = session.scalar(
                select(Checkpoint.name).where(Checkpoint.id == run.output_checkpoint_id)
            )
        report(stats, status, reason, timeline)
        if published:
            prompt = record_prompt(model_dir)
            started = time.perf_counter()
            answer = sample_completions(server.url, published, [prompt], max_tokens=48)[0]
            print(
                f"{published} answered in {time.perf_counter() - started:.2f} s: "
                f"{answer.text[:120]!r}"
            )
        return 0 if published else 1
    finally:
        if engine is not None:
            engine.dispose()
        server.stop()
        stack.postgres.stop()


def train_under_torchrun(
    settings: Settings, ranks: int, overrides: dict[str, int], timeline: Timeline
) -> int:
    """`rtrl train --once` on `ranks` GPUs; returns the run's id."""
    environment = {**os.environ, **settings_environment(settings)}
    environment |= {f"RTRL_TRAIN_{name.upper()}": str(value) for name, value in overrides.items()}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), "-m", "rtrl.cli", "train", "--once"]
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        timeline.progress(line.rstrip())
    if process.wait() != 0:
        raise SystemExit(f"torchrun exited with {process.returncode}")
    last = timeline.events[-1][1]  # "run <id>: <status> ..."
    return int(last.split()[1].rstrip(":"))


def record_prompt(model_dir: Path) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    from sandbox.tasks import heldout_tasks
    from trainer.generation import prompt_ids

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return prompt_ids(tokenizer, heldout_tasks(1, 1)[0].request)


def report(stats: dict[str, float], status: str, reason: str | None, timeline: Timeline) -> None:
    print(f"run: {status}" + (f" ({reason})" if reason else ""))
    if "drift_tokens" in stats:
        print(
            f"drift over {stats['drift_tokens']:.0f} tokens, trainer in {stats['dtype']} on "
            f"{stats['ranks']} rank(s):"
        )
        for name in DRIFT:
            limit = stats.get(f"drift_limit_{name}")
            print(
                f"  {name:<13} {stats.get(f'drift_{name}', float('nan')):.3e}"
                f"   limit {'none' if limit is None else f'{limit:.3g}'}"
            )
        print(f"  mean importance weight {stats.get('drift_mean_weight', float('nan')):.4f}")
    if "tokens_per_s" in stats:
        print(
            f"update: {stats['tokens']:.0f} completion tokens in {stats['update_seconds']:.1f} s "
            f"({stats['tokens_per_s']:.0f} tokens/s, {stats['optimizer_steps']:.0f} steps)"
        )
    published, evaluated = timeline.at("published ckpt-"), timeline.at("candidate held-out")
    if published is not None and evaluated is not None:
        print(f"save + publish + canary: {published - evaluated:.1f} s")
    print(f"cycle wall time: {timeline.events[-1][0]:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="HF model dir (default: the shipped rtrl-base)")
    parser.add_argument("--samples", type=int, default=256, help="on-policy samples to record")
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks in the gate")
    parser.add_argument("--ranks", type=int, default=1, help="GPUs to train on (torchrun)")
    parser.add_argument(
        "--vllm-memory", type=float, default=0.4, help="share of GPU 0's memory vLLM takes"
    )
    parser.add_argument("--max-model-len", type=int, help="vLLM --max-model-len (the model's)")
    parser.add_argument(
        "--cpu", action="store_true", help="run on the CPU build anyway (checks the script)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("device check: torch sees no CUDA GPU here; nothing to check")
        return
    transformers_logging.disable_progress_bar()
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} GPU(s)"
        print(f"{torch.cuda.get_device_name(0)}, {gpus}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="rtrl-device-check-") as scratch:
        raise SystemExit(check(args, Path(scratch)))


if __name__ == "__main__":
    main()
