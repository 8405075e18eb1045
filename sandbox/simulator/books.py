"""The books of simulated traffic: what the simulator was served against what Postgres holds.

What an operator audits after an incident: every completion the gateway answered has
exactly one sample and one finalized reward that saw the developer's verdict, every
feedback event the gateway accepted is stored once, and nothing else was written. Read
for the sessions the given runs worked in, so other traffic in the same database is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Row, func, or_, select

from app.db import session_scope
from app.models import FeedbackEventRow, Reward, Sample
from sandbox.simulator.report import EvidenceTally, RewardTally, SimulationReport

HISTORY_SOURCES = "history:%"
"""The feedback the gateway read from conversations (`app.signals.history`)."""


@dataclass
class Books:
    """What the database holds for one run's traffic, against what the simulator saw."""

    served: int
    samples: int
    missing_samples: list[str]
    """Answered requests without a sample."""
    unfinalized: list[str]
    """Answered requests whose reward is missing or not final."""
    orphans: list[str]
    """Samples of requests the simulator never got an answer to."""
    wrong_verdicts: list[str]
    """Rewards whose `accepted` differs from the verdict the client reported."""
    feedback_accepted: int
    """Feedback events the gateway accepted: on `/v1/feedback`, and made of client events."""
    feedback_stored: int
    """Of those, the ones stored (the gateway's own reading of conversations left out)."""
    rewards: RewardTally
    """The answered requests' final rewards."""

    @property
    def balanced(self) -> bool:
        return (
            not self.missing_samples
            and not self.unfinalized
            and not self.orphans
            and not self.wrong_verdicts
            and self.feedback_stored == self.feedback_accepted
        )

    def __str__(self) -> str:
        return (
            f"served {self.served}, samples {self.samples}, missing {self.missing_samples[:5]},"
            f" unfinalized {self.unfinalized[:5]}, orphans {self.orphans[:5]},"
            f" wrong verdicts {self.wrong_verdicts[:5]},"
            f" feedback stored {self.feedback_stored}/{self.feedback_accepted}"
        )


def read_books(engine: Engine, reports: list[SimulationReport]) -> Books:
    """The books of the sessions the simulator runs worked in (other traffic is not theirs)."""
    served = {r.request_id: r for report in reports for r in report.served}
    sessions = sorted({r.session_id for r in served.values()})
    with session_scope(engine) as session:
        rows = session.execute(
            select(Sample.request_id, Reward.finalized_at, Reward.components, Reward.reward)
            .outerjoin(Reward, Reward.sample_id == Sample.id)
            .where(Sample.session_id.in_(sessions))
        ).all()
        feedback_stored = (
            session.scalar(
                select(func.count())
                .select_from(FeedbackEventRow)
                .where(
                    FeedbackEventRow.session_id.in_(sessions),
                    # What the clients sent, not what the gateway read from the conversations.
                    or_(
                        FeedbackEventRow.source.is_(None),
                        FeedbackEventRow.source.not_like(HISTORY_SOURCES),
                    ),
                )
            )
            or 0
        )
    by_request = {row.request_id: row for row in rows}
    missing = sorted(served.keys() - by_request.keys())
    orphans = sorted(by_request.keys() - served.keys())
    unfinalized = sorted(
        rid for rid in served.keys() & by_request.keys() if by_request[rid].finalized_at is None
    )
    wrong = sorted(
        f"{rid} (stored {components.get('accepted')}, developer {request.accepted})"
        for rid, request in served.items()
        if rid in by_request
        and request.accepted is not None
        and request.verdict_reported
        and (components := by_request[rid].components or {}).get("accepted") != request.accepted
    )
    return Books(
        served=len(served),
        samples=len(rows),
        missing_samples=missing,
        unfinalized=unfinalized,
        orphans=orphans,
        wrong_verdicts=wrong,
        feedback_accepted=sum(
            report.feedback_events_accepted + report.continue_feedback_mapped for report in reports
        ),
        feedback_stored=feedback_stored,
        rewards=_tally([by_request[rid] for rid in served.keys() & by_request.keys()], len(served)),
    )


def _tally(rows: Sequence[Row[Any]], served: int) -> RewardTally:
    final = [row for row in rows if row.finalized_at is not None]
    rewarded = [row for row in final if row.reward is not None]
    edits = [
        row.components or {} for row in rewarded if (row.components or {}).get("proposed_edit")
    ]
    return RewardTally(
        served=served,
        finalized=len(final),
        rewarded=len(rewarded),
        rewarded_edits=len(edits),
        final_edits=sum(bool((row.components or {}).get("proposed_edit")) for row in final),
        kept_total=sum(float(components.get("kept") or 0.0) for components in edits),
        censored_edits=sum(components.get("kept") is None for components in edits),
    )


def read_final_books(
    engine: Engine, reports: list[SimulationReport], timeout_s: float, poll_s: float = 1.0
) -> Books:
    """The books once every answered request's reward is final, or as they stand when the
    timeout runs out."""
    deadline = time.monotonic() + timeout_s
    books = read_books(engine, reports)
    while (books.missing_samples or books.unfinalized) and time.monotonic() < deadline:
        time.sleep(poll_s)
        books = read_books(engine, reports)
    return books


def read_evidence(engine: Engine, reports: list[SimulationReport]) -> EvidenceTally:
    """What the gateway read from the conversations of the reports' stock-agent runs, against
    the simulator's ground truth: each `history:*` feedback event on a served turn, agreeing
    when an accept names an applied edit, a reject a refused or unapplicable one, and a
    follow-up the developer's satisfaction as the turn's final reward saw it, and a survival
    window an edit that was applied."""
    served = {r.request_id: r for report in reports for r in report.served}
    with session_scope(engine) as session:
        events = session.execute(
            select(
                FeedbackEventRow.request_id,
                FeedbackEventRow.kind,
                FeedbackEventRow.source,
                FeedbackEventRow.dissatisfied,
            ).where(
                FeedbackEventRow.request_id.in_(list(served)),
                FeedbackEventRow.source.like(HISTORY_SOURCES),
            )
        ).all()
        components: dict[str, dict[str, Any] | None] = dict(
            session.execute(
                select(Sample.request_id, Reward.components)
                .join(Reward, Reward.sample_id == Sample.id)
                .where(Sample.request_id.in_(list(served)))
            ).all()
        )
    by_source: dict[str, list[int]] = {}
    verdicts: set[str] = set()
    followups: set[str] = set()
    for event in events:
        truth = served[event.request_id]
        kind = str(getattr(event.kind, "value", event.kind))
        if kind == "edit_accepted":
            agree = truth.edit_outcome == "applied"
            verdicts.add(event.request_id)
        elif kind == "edit_rejected":
            agree = truth.edit_outcome in ("refused", "unapplicable")
            verdicts.add(event.request_id)
        elif kind == "followup_message":
            seen = event.dissatisfied
            if seen is None:
                seen = (components.get(event.request_id) or {}).get("dissatisfied")
            # A final answer's follow-up says what the developer made of the run; one on a
            # turn whose edit they refused (an interrupt) is their refusal.
            expected = truth.followup_dissatisfied
            if expected is None and truth.edit_outcome == "refused":
                expected = True
            agree = expected is not None and seen == expected
            if truth.followup_dissatisfied is not None:
                followups.add(event.request_id)
        elif kind == "edit_survival":
            # A window read from a later read of the file belongs on an edit that was applied.
            agree = truth.edit_outcome == "applied"
        else:
            continue
        tally = by_source.setdefault(event.source, [0, 0])
        tally[0] += 1
        tally[1] += agree
    edit_turns = [r for r in served.values() if r.edit_outcome is not None]
    answers = [r for r in served.values() if r.followup_dissatisfied is not None]
    return EvidenceTally(
        by_source={source: (read, agree) for source, (read, agree) in by_source.items()},
        edit_turns=len(edit_turns),
        edit_turns_read=sum(r.request_id in verdicts for r in edit_turns),
        final_answers=len(answers),
        final_answers_read=sum(r.request_id in followups for r in answers),
    )
