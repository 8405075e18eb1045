"""How each checkpoint's agent runs went, over users: the four numbers the agent demo reads.

Every metric is a ratio of per-user sums, estimated over the users a checkpoint served
(users, not runs, are what the A/B split randomizes), with the delta-method interval of
`app.abtest.stats`; a checkpoint is compared with a reference one (control, or the base
model) by the difference of the two ratios and its 95% interval.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import scipy.stats

from app.abtest.stats import (
    CONFIDENCE,
    Comparison,
    RatioEstimate,
    compare_ratios,
    user_ratio,
)
from sandbox.simulator.report import AgentRun

# metric -> (numerator, denominator) of one run, summed per user
AGENT_METRICS: dict[str, Callable[[AgentRun], tuple[float, float]]] = {
    # Runs whose edit the developer accepted (and so kept), of all runs.
    "kept_edit_rate": lambda run: (float(bool(run.accepted)), 1.0),
    # Calls the parser could not read, to unknown tools or missing an argument, of all calls.
    "malformed_call_rate": lambda run: (float(run.malformed_calls), float(run.tool_calls)),
    # Runs (each an edit request) whose first answer asked a question instead of acting.
    "clarifying_question_rate": lambda run: (float(run.clarifying_question), 1.0),
    # Turns the solved runs took, per solved run.
    "turns_per_solved_task": lambda run: (
        float(run.turns if run.solved else 0),
        float(run.solved),
    ),
}
PERCENT = {"kept_edit_rate", "malformed_call_rate", "clarifying_question_rate"}


@dataclass(frozen=True)
class MetricValue:
    value: float | None
    ci_low: float | None
    ci_high: float | None
    versus: Comparison | None = None
    """This checkpoint minus the reference checkpoint, over users."""


@dataclass(frozen=True)
class Scorecard:
    checkpoint: str
    users: int
    runs: int
    metrics: dict[str, MetricValue]


def scorecards(runs: Sequence[AgentRun], reference: str | None = None) -> list[Scorecard]:
    """One scorecard per checkpoint, the reference first, each compared with the reference."""
    by_checkpoint: dict[str, dict[str, list[AgentRun]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_checkpoint[run.checkpoint][run.user_id].append(run)
    order = sorted(by_checkpoint, key=lambda name: (name != reference, name))
    cards = []
    for name in order:
        users = by_checkpoint[name]
        metrics = {}
        for metric, of_run in AGENT_METRICS.items():
            estimate = _estimate(users, of_run)
            versus = None
            if reference is not None and name != reference and reference in by_checkpoint:
                baseline = _estimate(by_checkpoint[reference], of_run)
                if estimate is not None and baseline is not None:
                    versus = compare_ratios(estimate, baseline)
            if estimate is None:
                metrics[metric] = MetricValue(None, None, None, versus)
                continue
            margin = float(
                scipy.stats.t.ppf(0.5 + CONFIDENCE / 2, estimate.users - 1)
                * estimate.covariance[0, 0] ** 0.5
            )
            metrics[metric] = MetricValue(
                estimate.value, estimate.value - margin, estimate.value + margin, versus
            )
        cards.append(Scorecard(name, len(users), sum(len(r) for r in users.values()), metrics))
    return cards


def _estimate(
    users: dict[str, list[AgentRun]], of_run: Callable[[AgentRun], tuple[float, float]]
) -> RatioEstimate | None:
    per_user = []
    for user_runs in users.values():
        pairs = [of_run(run) for run in user_runs]
        per_user.append((sum(y for y, _ in pairs), sum(n for _, n in pairs)))
    return user_ratio(per_user)


def _cell(metric: str, value: MetricValue) -> str:
    if value.value is None:
        return "-"
    scale, unit = (100, "%") if metric in PERCENT else (1, "")
    text = f"{value.value * scale:.1f}{unit}"
    versus = value.versus
    if versus is not None and versus.ci_low is not None and versus.ci_high is not None:
        unit = "pp" if metric in PERCENT else ""
        text += (
            f" ({versus.difference * scale:+.1f}{unit}"
            f" [{versus.ci_low * scale:+.1f}, {versus.ci_high * scale:+.1f}])"
        )
    elif value.ci_low is not None and value.ci_high is not None:
        text += f" [{value.ci_low * scale:.1f}, {value.ci_high * scale:.1f}]"
    return text


def scorecard_table(cards: Sequence[Scorecard]) -> str:
    """The scorecards as text: one row per checkpoint; differences against the first row."""
    widths = (10, 5, 5, 28, 28, 28, 24)
    header = (
        "checkpoint",
        "users",
        "runs",
        "kept edits",
        "malformed calls",
        "clarifying questions",
        "turns per solved task",
    )
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True))]
    for card in cards:
        cells = (
            card.checkpoint,
            str(card.users),
            str(card.runs),
            *(_cell(metric, card.metrics[metric]) for metric in AGENT_METRICS),
        )
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True)))
    lines.append(
        "over users (the unit of randomization), 95% intervals; (difference [interval])"
        " against the first row"
    )
    return "\n".join(lines)
