"""Long prompts: how long the embedded vLLM takes to answer a stock agent's prompt sizes.

Stock coding agents open with 2k-55k tokens of system prompt and tool declarations (in the
shipped bases' tokenizer, about 1.45 characters a token) and grow from there; the shipped bases
serve a 131,072-token context. This starts a vLLM on a shipped base (fp32, as rtrl starts it on
a CPU) and sends one-message chats of about --sizes tokens each (the project's own docs,
repeated to length), one at a time, each asking 16 tokens, and prints each one's prompt tokens,
status and time to the whole answer. The first size is the baseline: the same request with a
short prompt, so the table shows what the prompt's length alone adds.

    python -m bench.long_prompts [--base rtrl-base] [--sizes 1000,21000,42000,84000,126000]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from transformers import PreTrainedTokenizerFast

from app.processes import free_port
from app.serving.vllm import VllmServer
from sandbox.bases import DEFAULT_BASE, shipped_base_dir

ROOT = Path(__file__).resolve().parents[1]
ANSWER_TOKENS = 16


def text_of(tokenizer: PreTrainedTokenizerFast, tokens: int) -> str:
    """The project's docs, repeated and cut to about `tokens` tokens."""
    corpus = "\n\n".join(path.read_text() for path in sorted((ROOT / "docs").rglob("*.md")))
    per_char = len(tokenizer(corpus[:20_000])["input_ids"]) / 20_000
    wanted = int(tokens / per_char)
    return (corpus * (wanted // len(corpus) + 1))[:wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=DEFAULT_BASE, help="a shipped base's name")
    parser.add_argument("--sizes", default="1000,21000,42000,84000,126000")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]

    with tempfile.TemporaryDirectory(prefix="rtrl-bench-long-") as scratch:
        root = Path(scratch)
        model = shutil.copytree(shipped_base_dir(args.base), root / "model")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
        server = VllmServer(model_dir=model, port=free_port(), root=root, dtype="float32")
        started = time.monotonic()
        server.start(timeout=300)
        print(f"vLLM on {args.base} started in {time.monotonic() - started:.1f} s")
        try:
            context = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
            print(f"context: {context:,} tokens; each request asks {ANSWER_TOKENS} tokens")
            print(f"{'prompt tokens':>14} │ status │ seconds │ vs. the first")
            baseline = None
            for size in sizes:
                body = {
                    "model": "base",
                    "messages": [{"role": "user", "content": text_of(tokenizer, size)}],
                    "max_tokens": ANSWER_TOKENS,
                }
                sent = time.monotonic()
                answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=900)
                seconds = time.monotonic() - sent
                baseline = baseline or seconds
                prompt = (answer.json().get("usage") or {}).get("prompt_tokens", 0)
                print(
                    f"{prompt:>14,} │ {answer.status_code:>6} │ {seconds:>7.1f} │"
                    f" {seconds / baseline:>6.1f}×"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
