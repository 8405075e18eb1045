"""How the simulated IDE talks to rtrl: as the ideal client, a stock one, or Continue.

- ideal: a fresh `X-Session-Id` per session and an `X-Request-Id` per request; every verdict,
  survival window, follow-up and `session_end` on `/v1/feedback`. A share of developers may
  close the IDE before the 10- and 15-minute windows, which then are never reported.
- stock (Cline, Roo Code, Aider configured with a base URL and a key): the static `X-User-Id`
  only, and no feedback at all; the gateway derives the session and names it in
  `X-Rtrl-Session-Id`.
- continue (Continue with its data destination pointed at rtrl): the static `X-User-Id`
  only, and Continue's own events (`toolUsage`, `chatFeedback`) on `/v1/adapters/continue`,
  one per request and never retried (`sandbox.simulator.continue_events`).
- claude-code, codex, opencode, cline (agent sessions only): the stock agent as it runs, no
  feedback at all. An edit call waits for the developer at a permission prompt; what became of
  it reaches the gateway only in the client's own words in the next request
  (`sandbox.simulator.renderings`), and the verdict on a final answer only as the developer's
  next message in the same conversation.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Literal

from sandbox.simulator.population import Developer
from sandbox.simulator.renderings import RENDERED_CLIENTS, RenderedClient

ClientMode = Literal["ideal", "stock", "continue", RenderedClient]
CLIENT_MODES: tuple[ClientMode, ...] = ("ideal", "stock", "continue", *RENDERED_CLIENTS)
IDE_CLOSED_BEFORE_S = 600.0
"""The first survival window a developer who closes the IDE early never reaches (10 min)."""
ContinueSchema = Literal["0.1.0", "0.2.0"]
ContinueLevel = Literal["all", "noCode"]


@dataclass(frozen=True)
class ClientConfig:
    """Which client the developers use, and the habits that decide what it reports."""

    mode: ClientMode = "ideal"
    ide_closes_share: float = 0.0
    """ideal: share of developers who close the IDE before the 10- and 15-minute windows."""
    unlooked_edit_share: float = 0.3
    """continue: share of edit calls approved without a look (auto-approve): applied, and
    no `toolUsage` is sent for them."""
    nocode_share: float = 0.2
    """continue: share of developers whose destination has level `noCode` (no code, no text:
    their `chatFeedback` cannot be joined to an answer)."""
    old_schema_share: float = 0.1
    """continue: share of developers whose destination has schema 0.1.0, which has no
    `toolUsage` event (only `chatFeedback` is sent)."""
    thumbs_up_share: float = 0.2
    """continue: chance a satisfied developer gives the run's final answer a thumbs up (a
    dissatisfied one always gives a thumbs down)."""
    approves_passing: float = 0.95
    """claude-code, codex, opencode, cline: chance the developer approves, at the permission
    prompt, an edit after which the file passes the task's checks."""
    approves_failing: float = 0.3
    """The same for an edit after which it does not (a step on the way, or let through)."""

    def __post_init__(self) -> None:
        if self.mode not in CLIENT_MODES:
            raise ValueError(f"client mode must be one of {', '.join(CLIENT_MODES)}")
        shares = {
            "ide_closes_share": self.ide_closes_share,
            "unlooked_edit_share": self.unlooked_edit_share,
            "nocode_share": self.nocode_share,
            "old_schema_share": self.old_schema_share,
            "thumbs_up_share": self.thumbs_up_share,
            "approves_passing": self.approves_passing,
            "approves_failing": self.approves_failing,
        }
        for name, share in shares.items():
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} is a share between 0 and 1, not {share}")


@dataclass(frozen=True)
class Destination:
    """A developer's Continue data destination, as set once in their config.yaml."""

    schema: ContinueSchema = "0.2.0"
    level: ContinueLevel = "all"


@dataclass
class Ide:
    """The IDE one developer works in for one session: its client and their habits with it."""

    config: ClientConfig
    closes_early: bool
    """ideal: the IDE is closed before the 10-minute survival window."""
    destination: Destination
    rng: random.Random
    """The client's own draws (a glance at an edit, a thumb), apart from the developer's."""

    @property
    def mode(self) -> ClientMode:
        return self.config.mode

    def looks_at_edit(self) -> bool:
        """Whether the developer reads an edit call before approving it."""
        return self.rng.random() >= self.config.unlooked_edit_share

    def gives_thumbs_up(self) -> bool:
        return self.rng.random() < self.config.thumbs_up_share

    @property
    def rendered(self) -> RenderedClient | None:
        """The stock agent this IDE plays, if it plays one."""
        mode = self.config.mode
        return mode if mode in RENDERED_CLIENTS else None

    def approves(self, passes: bool) -> bool:
        """The developer's answer at the permission prompt for an edit after which the file
        passes the task's checks (`passes`) or not."""
        share = self.config.approves_passing if passes else self.config.approves_failing
        return self.rng.random() < share

    def new_chat_session(self) -> str:
        """The id Continue gives a new chat (each task starts one)."""
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))


def ideal_ide() -> Ide:
    """The ideal client, for sessions built without a workload (tests, one-off runs)."""
    return Ide(ClientConfig(), False, Destination(), random.Random(0))


def ide_for_session(config: ClientConfig, developer: Developer, session: int) -> Ide:
    """The IDE `developer` uses in their session number `session`: the developer's habits
    are theirs in every session; the draws are the session's own, so the ideal, stock and
    continue runs of one seed give the developers the same tasks and reactions."""
    habits = random.Random(f"rtrl-simulator-client:{developer.user_id}")
    closes_early = habits.random() < config.ide_closes_share
    schema: ContinueSchema = "0.1.0" if habits.random() < config.old_schema_share else "0.2.0"
    level: ContinueLevel = "noCode" if habits.random() < config.nocode_share else "all"
    rng = random.Random(f"rtrl-simulator-client:{developer.user_id}:{session}")
    return Ide(config, closes_early, Destination(schema, level), rng)
