"""What vLLM sampled a completion from, and whether the trainer can reproduce it.

The trainer recomputes each served token's probability under the policy at the logged
temperature and weighs it against vLLM's behaviour logprob. Anything else that changed the
distribution vLLM sampled from (a bias, a penalty, a mask, a grammar, a forced tool, beam
search, a floor under the answer's length, EOS ignored) leaves logprobs of a distribution it
cannot rebuild: such an answer is served, logged and scored like any other, never trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NEUTRAL_SAMPLING: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
"""vLLM's neutral value of every parameter a model's `generation_config.json` may set. The
gateway sends each one a request leaves out, so that vLLM applies what the event logs
whatever defaults the model ships (vLLM applies those to parameters a request omits)."""

_NUMERIC_NEUTRAL = {
    name: NEUTRAL_SAMPLING[name]
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
} | {"min_tokens": 0}
_PRESENT = ("structured_outputs", "allowed_token_ids", "thinking_token_budget", "vllm_xargs")
_TRUE = ("ignore_eos", "use_beam_search", "watermarking")
_NON_EMPTY = ("logit_bias", "bad_words")


def sampling_constraints(body: Mapping[str, Any]) -> list[str]:
    """The parameters of a chat request, as sent, that make its sample one the trainer
    cannot reproduce (sorted; empty when it can)."""
    found = [
        name
        for name, neutral in _NUMERIC_NEUTRAL.items()
        if body.get(name) is not None and _number(body[name]) != neutral
    ]
    found += [name for name in _PRESENT if body.get(name) is not None]
    found += [name for name in _TRUE if body.get(name) is True]
    found += [name for name in _NON_EMPTY if body.get(name)]
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        found.append("response_format")
    tool_choice = body.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        found.append("tool_choice")  # decoding constrained to the tools' schemas
    return sorted(found)


def with_neutral_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with every sampling parameter it leaves out set to vLLM's neutral value."""
    filled = dict(body)
    for name, neutral in NEUTRAL_SAMPLING.items():
        if filled.get(name) is None:
            filled[name] = neutral
    return filled


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # not a number: vLLM refuses the request, nothing is sampled
