"""What the demo prints: the A/B tables an analyst reads, the predictions' scoreboard, the
cycles' table and the verdict lines."""

from __future__ import annotations

from typing import Any

from app.abtest.stats import Comparison
from rtrl.demo.clients import treatment_kept
from rtrl.demo.records import CycleRecord, DemoSummary
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.scorecard import Scorecard


def served_line(report: SimulationReport) -> str:
    return (
        f"  served {report.requests_ok} requests"
        f" ({report.requests_failed} failed) in {report.wall_s:.0f} s"
    )


def _cell(metric: dict[str, Any], percent: bool) -> str:
    value = metric.get("value")
    if value is None:
        return "-"
    text = f"{value * 100:.1f}%" if percent else f"{value:.3g}"
    versus = metric.get("vs_control")
    if versus and versus.get("ci_low") is not None:
        scale = 100 if percent else 1
        unit = "pp" if percent else ""
        text += (
            f" ({versus['difference'] * scale:+.1f}{unit},"
            f" CI {versus['ci_low'] * scale:+.1f}..{versus['ci_high'] * scale:+.1f})"
        )
    return text


def ab_table(body: dict[str, Any]) -> str:
    """The per-arm table an analyst reads, as text."""
    lines = [
        f"{'arm':<10} {'checkpoint':<10} {'users':>5} {'reqs':>5}  {'kept':<30}"
        f" {'dissatisfied':<30} {'p50 ms':>7}  mean reward"
    ]
    for arm in body["arms"]:
        metrics = arm["metrics"]
        p50 = metrics.get("latency_p50_ms", {}).get("value")
        p50_text = "-" if p50 is None else str(round(p50))
        lines.append(
            f"{arm['arm']:<10} {arm['checkpoint'] or '-':<10} {arm['users']:>5}"
            f" {arm['requests']:>5}  {_cell(metrics['kept'], True):<30}"
            f" {_cell(metrics['dissatisfied_rate'], True):<30}"
            f" {p50_text:>7}  {_cell(metrics['mean_reward'], False)}"
        )
    switched = sum(arm.get("switched_users", 0) for arm in body["arms"])
    lines.append(
        f"intervals over {body.get('unit', 'user')}s, each in the arm of their first exposure;"
        f" {switched} seen in two arms left out"
    )
    ratio = body.get("sample_ratio")
    if ratio:
        lines.append(
            f"sample ratio check (users at first exposure): p = {ratio['p_value']:.3f}"
            + ("  MISMATCH: do not trust these results" if ratio["mismatch"] else "  ok")
        )
    return "\n".join(lines)


def prediction_table(body: dict[str, Any]) -> str:
    """Each candidate's mean reward and kept rate as predicted before its canary, against
    what the canary realized, as text."""
    lines = [
        "predicted (from production's logs, before the canary) vs realized (the canary's A/B):",
        f"{'candidate':<10} {'metric':<12} {'predicted':<26} {'realized':<26} sign  in-CI  trust",
    ]
    for record in reversed(body["records"]):
        for metric in record["metrics"]:
            if metric["metric"] in ("mean_reward", "kept"):
                lines.append(_prediction_row(record, metric))
    for score in body["scores"]:
        if score["compared"]:
            shares = [
                "-" if score[name] is None else f"{score[name]:.0%}"
                for name in ("sign_agreement", "realized_in_interval")
            ]
            lines.append(
                f"{score['metric']}: {score['compared']} reliable predictions compared, sign "
                f"agreed {shares[0]}, realized inside the interval {shares[1]}"
            )
    return "\n".join(lines)


def _prediction_row(record: dict[str, Any], metric: dict[str, Any]) -> str:
    predicted = _difference(
        metric["predicted"], metric["predicted_ci_low"], metric["predicted_ci_high"]
    )
    realized = (
        "-"
        if metric["realized"] is None
        else _difference(metric["realized"], metric["realized_ci_low"], metric["realized_ci_high"])
    )
    flags = [
        "-" if flag is None else ("yes" if flag else "no")
        for flag in (metric["sign_agrees"], metric["realized_in_interval"])
    ]
    trust = "reliable" if metric["reliable"] else "unreliable: " + "; ".join(metric["unreliable"])
    return (
        f"{record['checkpoint'] or record['status']:<10} {metric['metric']:<12}"
        f" {predicted:<26} {realized:<26} {flags[0]:<5} {flags[1]:<6} {trust}"
    )


def _difference(value: float, low: float | None, high: float | None) -> str:
    if low is None or high is None:
        return f"{value:+.3f}"
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def cycle_table(records: list[CycleRecord]) -> str:
    """One row per cycle: formula, candidate, its held-out differences, alerts, decision."""
    alerts = [", ".join(record.alerts) or "-" for record in records]
    width = max([len("alerts"), *map(len, alerts)]) + 2
    header = (
        f"{'cycle':<6}{'formula':<8}{'candidate':<11}{'kept pp':>8}{'malformed pp':>13}"
        f"{'questions pp':>13}{'edit rate pp':>13}  {'alerts':<{width}}decision"
    )
    lines = [
        "cycles (candidate minus control on held-out tasks; kept, malformed and questions from"
        " the agent runs over users, edit rate from /analytics):",
        header,
    ]
    for record, alerted in zip(records, alerts, strict=True):
        lines.append(
            f"{record.cycle:<6}{record.reward_version:<8}{record.candidate or '-':<11}"
            f"{_card_difference(record.card, 'kept_edit_rate'):>8}"
            f"{_card_difference(record.card, 'malformed_call_rate'):>13}"
            f"{_card_difference(record.card, 'clarifying_question_rate'):>13}"
            f"{_ab_difference(record, 'edit_rate'):>13}  {alerted:<{width}}{record.decision}"
        )
    return "\n".join(lines)


def _card_difference(card: Scorecard | None, metric: str) -> str:
    versus = card.metrics[metric].versus if card else None
    if versus is None:
        return "-"
    scale = 1 if metric == "turns_per_solved_task" else 100
    return f"{versus.difference * scale:+.1f}"


def _ab_difference(record: CycleRecord, metric: str) -> str:
    versus = (record.ab.get(metric) or {}).get("vs_control") or {}
    value = versus.get("difference")
    return "-" if value is None else f"{value * 100:+.1f}"


def _improvement(ci_low: float) -> str:
    if ci_low > 0:
        return "excludes 0: the loop made the assistant better"
    return "includes 0: no proven improvement"


def served_kept_line(body: dict[str, Any]) -> str | None:
    """The served holdback's kept rate, base to final, and whether its interval proves a gain;
    None when there is no interval."""
    control_kept = next(a for a in body["arms"] if a["is_control"])["metrics"]["kept"]
    kept = treatment_kept(body)
    versus = kept.get("vs_control") or {}
    if versus.get("ci_low") is None:
        return None
    return (
        f"served kept rate {control_kept['value'] * 100:.1f}% ->"
        f" {kept['value'] * 100:.1f}%: {versus['difference'] * 100:+.1f} pp, 95% CI"
        f" [{versus['ci_low'] * 100:+.1f}, {versus['ci_high'] * 100:+.1f}] pp,"
        f" {_improvement(versus['ci_low'])}"
    )


def offline_solved_line(solved: Comparison | None) -> str | None:
    """The offline runs' solved share, final minus base, and whether its interval proves a
    gain; None when there is no interval."""
    if solved is None or solved.ci_low is None or solved.ci_high is None:
        return None
    return (
        f"offline held-out runs solved: {solved.difference * 100:+.1f} pp, 95% CI"
        f" [{solved.ci_low * 100:+.1f}, {solved.ci_high * 100:+.1f}] pp,"
        f" {_improvement(solved.ci_low)}"
    )


def hacking_verdict(summary: DemoSummary) -> str:
    """The reward-hacking scenario's last line: what the monitors caught, and where it went."""
    if not summary.caught:
        return (
            "no monitor alerted: no candidate moved a monitored metric beyond its threshold"
            " and clear of noise over developers"
        )
    found = "; ".join(
        f"cycle {r.cycle}: {', '.join(r.alerts)} on {r.candidate} ({r.decision})"
        for r in summary.caught
    )
    kept_out = "kept out of production" if summary.proven else "NOT kept out of production"
    return f"the monitors caught the hack ({found}): {kept_out}"
