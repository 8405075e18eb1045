"""The books of a simulation: what was sent, what was served, by which checkpoint."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from sandbox.simulator.clients import ClientMode

EditOutcome = Literal["applied", "refused", "unapplicable"]


@dataclass(frozen=True)
class ServedRequest:
    """One completion the gateway served, and what the developer made of it."""

    request_id: str
    session_id: str
    user_id: str
    task_id: str
    checkpoint: str
    latency_s: float
    proposed_edit: bool
    accepted: bool | None
    """None when the developer abandoned the session before judging the answer."""
    verdict_reported: bool = True
    """Whether the client told the gateway the developer's verdict (stock clients never do)."""
    malformed_calls: int = 0
    """Calls of this turn the IDE could not run (see `sandbox.simulator.toolcalls`)."""
    edit_outcome: EditOutcome | None = None
    """A stock agent's edit turn: what became of its edit calls, as the developer and the
    file decided (ground truth; applied wins over refused over unapplicable)."""
    followup_dissatisfied: bool | None = None
    """A stock agent's final answer: whether the developer's next message complained."""


@dataclass(frozen=True)
class RewardTally:
    """What Postgres holds for a run's answered requests, read once their rewards are final."""

    served: int
    finalized: int
    rewarded: int
    """Final rewards with a value (before formula 6, an edit whose fate was never reported
    had none)."""
    rewarded_edits: int
    """Of those, the ones whose answer proposed an edit."""
    kept_total: float
    """The kept share of the rewarded edits whose fate was seen, summed."""
    final_edits: int = 0
    """Final rewards (with a value or not) whose answer proposed an edit."""
    censored_edits: int = 0
    """Of the rewarded edits, those whose fate was never seen (kept unknown): rewarded at the
    formula's prior, not from a verdict."""

    @property
    def rewarded_share(self) -> float:
        """Share of answered requests that ended with a reward."""
        return self.rewarded / self.served if self.served else 0.0

    @property
    def kept_share(self) -> float:
        """Mean kept share over the rewarded edits whose fate was seen."""
        seen = self.rewarded_edits - self.censored_edits
        return self.kept_total / seen if seen else 0.0


@dataclass(frozen=True)
class EvidenceTally:
    """The verdicts the gateway read from stock agents' conversations (`history:*` feedback)
    against what the simulated developers and files decided."""

    by_source: dict[str, tuple[int, int]]
    """Per rule (`history:<client>:<rule>`): (events read, events that agree with the truth)."""
    edit_turns: int
    """Turns whose edit's fate is known to the simulator (applied, refused, unapplicable)."""
    edit_turns_read: int
    """Of those, the ones the gateway read an accept or reject for."""
    final_answers: int
    """Final answers the developer answered in the same conversation."""
    final_answers_read: int

    def lines(self) -> list[str]:
        recall = f"edit verdicts read on {self.edit_turns_read}/{self.edit_turns} edit turns"
        answers = f"follow-ups read on {self.final_answers_read}/{self.final_answers} answers"
        lines = [f"evidence from the conversation: {recall}, {answers}"]
        for source, (read, agree) in sorted(self.by_source.items()):
            lines.append(f"  {source}: {agree}/{read} agree ({agree / read:.0%})")
        return lines


@dataclass(frozen=True)
class AgentRun:
    """One agent run on one task: how it went and how the developer judged it."""

    user_id: str
    checkpoint: str
    task_id: str
    turns: int
    edited: bool
    """At least one edit applied to the workspace."""
    solved: bool
    """The file passes the task's hidden checks after the run."""
    accepted: bool | None
    tool_calls: int
    malformed_calls: int
    """Calls the parser could not read, to unknown tools, or missing a required argument."""
    clarifying_question: bool
    """The run's first answer asked a question instead of acting."""
    read_before_edit: bool
    abandoned: bool


@dataclass
class CheckpointStats:
    """How one checkpoint's answers fared with the simulated developers."""

    requests: int = 0
    proposed_edits: int = 0
    accepted_edits: int = 0
    total_latency_s: float = 0.0

    @property
    def proposed_edit_rate(self) -> float:
        """Share of answers that proposed code."""
        return self.proposed_edits / self.requests if self.requests else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of proposed edits that passed the hidden checks (and so were accepted)."""
        return self.accepted_edits / self.proposed_edits if self.proposed_edits else 0.0

    @property
    def kept_rate(self) -> float:
        """Share of answers accepted: the reward's view, where proposing no code counts 0."""
        return self.accepted_edits / self.requests if self.requests else 0.0

    @property
    def mean_latency_s(self) -> float:
        """Mean time from sending the request to reading the answer."""
        return self.total_latency_s / self.requests if self.requests else 0.0


@dataclass
class SimulationReport:
    """Counts of one run; requests_sent = requests_ok + requests_failed, always."""

    client: ClientMode = "ideal"
    requests_sent: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    retries: int = 0
    """Waits on a 429 or 503 answer, for its Retry-After, before sending again."""
    errors: Counter[str] = field(default_factory=Counter)
    """Failed requests and feedback batches by cause, e.g. `chat:http_500`, `feedback:timeout`."""
    sessions_started: int = 0
    sessions_ended: int = 0
    """Sessions that ended; with the ideal client, those whose `session_end` the gateway
    accepted (other clients send none)."""
    sessions_abandoned: int = 0
    """Sessions a developer left because an answer took far longer than their patience."""
    sessions_cut: int = 0
    """Sessions still open when the run hit its time limit."""
    feedback_batches_sent: int = 0
    feedback_batches_accepted: int = 0
    feedback_batches_failed: int = 0
    feedback_events_sent: int = 0
    feedback_events_accepted: int = 0
    """Events in batches answered 202 (new and duplicate alike)."""
    continue_events_sent: int = 0
    continue_events_failed: int = 0
    """Continue events that got no 202: lost, since Continue does not retry."""
    continue_outcomes: Counter[str] = field(default_factory=Counter)
    """Answered Continue events by `<event name>:<outcome>`, e.g. `toolUsage:mapped`."""
    continue_feedback_mapped: int = 0
    """rtrl feedback events the gateway made of the Continue events it mapped."""
    rewards: RewardTally | None = None
    """Read from Postgres once the run's rewards are final; None when not read."""
    evidence: EvidenceTally | None = None
    """Read with the rewards, for a stock agent's run; None when not read."""
    served: list[ServedRequest] = field(default_factory=list)
    runs: list[AgentRun] = field(default_factory=list)
    """Agent runs, in agent mode."""
    checkpoints: dict[str, CheckpointStats] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def served_request_ids(self) -> list[str]:
        """Every request id the gateway answered, in the order the answers arrived."""
        return [served.request_id for served in self.served]

    def record_served(self, served: ServedRequest) -> None:
        """Count an answered request under the checkpoint that served it."""
        self.requests_ok += 1
        self.served.append(served)
        stats = self.checkpoints.setdefault(served.checkpoint, CheckpointStats())
        stats.requests += 1
        stats.proposed_edits += served.proposed_edit
        stats.accepted_edits += bool(served.accepted)
        stats.total_latency_s += served.latency_s

    def record_run(self, run: AgentRun) -> None:
        self.runs.append(run)

    @property
    def malformed_turns(self) -> int:
        """Answered requests with at least one call the IDE could not run."""
        return sum(served.malformed_calls > 0 for served in self.served)

    @property
    def continue_events_by_outcome(self) -> Counter[str]:
        """Answered Continue events by outcome (mapped, duplicate, unjoinable, ignored)."""
        outcomes: Counter[str] = Counter()
        for key, count in self.continue_outcomes.items():
            outcomes[key.rsplit(":", 1)[1]] += count
        return outcomes

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [
            f"client: {self.client}",
            f"sessions: {self.sessions_started} started, {self.sessions_ended} ended, "
            f"{self.sessions_abandoned} abandoned, {self.sessions_cut} cut",
            f"requests: {self.requests_sent} sent, {self.requests_ok} ok, "
            f"{self.requests_failed} failed, {self.retries} retries",
            f"feedback: {self.feedback_batches_accepted}/{self.feedback_batches_sent} batches "
            f"accepted ({self.feedback_events_accepted}/{self.feedback_events_sent} events)",
        ]
        lines += [
            f"  {name}: {stats.requests} requests, edits proposed {stats.proposed_edit_rate:.0%}, "
            f"accepted {stats.acceptance_rate:.0%} of edits ({stats.kept_rate:.0%} of answers), "
            f"mean latency {stats.mean_latency_s * 1000:.0f} ms"
            for name, stats in sorted(self.checkpoints.items())
        ]
        for name in sorted({run.checkpoint for run in self.runs}):
            runs = [run for run in self.runs if run.checkpoint == name]
            solved = [run for run in runs if run.solved]
            calls = sum(run.tool_calls for run in runs)
            lines.append(
                f"  {name} agent runs: {len(runs)}, solved {len(solved) / len(runs):.0%},"
                f" malformed calls {sum(r.malformed_calls for r in runs) / max(calls, 1):.0%}"
                f" of {calls}, clarifying questions"
                f" {sum(r.clarifying_question for r in runs) / len(runs):.0%},"
                f" turns per solved task"
                f" {sum(r.turns for r in solved) / max(len(solved), 1):.1f}"
            )
        if self.client == "continue":
            outcomes = ", ".join(f"{key} x{n}" for key, n in sorted(self.continue_outcomes.items()))
            lines.append(
                f"continue events: {self.continue_events_sent} sent,"
                f" {self.continue_events_failed} lost ({outcomes or 'none answered'})"
            )
        if self.runs and self.requests_ok:
            lines.append(
                f"turns with a malformed call: {self.malformed_turns}/{self.requests_ok}"
                f" ({self.malformed_turns / self.requests_ok:.0%})"
            )
        if self.rewards is not None:
            tally = self.rewards
            lines.append(
                f"rewards: {tally.finalized}/{tally.served} final, {tally.rewarded} with a"
                f" reward ({tally.rewarded_share:.0%}); {tally.rewarded_edits}/{tally.final_edits}"
                f" edits with a reward ({tally.censored_edits} censored: fate never seen),"
                f" kept {tally.kept_share:.2f} over the others"
            )
        if self.evidence is not None:
            lines += self.evidence.lines()
        if self.errors:
            causes = ", ".join(f"{cause} x{n}" for cause, n in self.errors.most_common())
            lines.append(f"errors: {causes}")
        lines.append(f"wall time: {self.wall_s:.1f} s")
        return "\n".join(lines)
