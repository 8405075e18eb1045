"""Synthetic developers: who they are, what language they write, how patient they are."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sandbox.tasks import Language

IMPATIENT_SHARE = 0.2
"""Share of developers whose patience is short enough to notice a slow model."""


@dataclass(frozen=True)
class Developer:
    """One simulated IDE user; the same seed and index always give the same developer."""

    user_id: str
    """Sent as `X-User-Id`: the unit of A/B assignment, stable across sessions and runs."""
    language: Language
    """The language the developer usually writes requests and follow-ups in."""
    other_language_rate: float
    """Share of requests written in the other language (bilingual teams)."""
    patience_s: float
    """Longest wait for an answer that goes unremarked (the latency rule is in `reactions`)."""
    think_time_s: float
    """Real seconds between one task and the next, compressed by the run's time scale."""
    tweak_rate: float
    """Chance, per survival window, of touching up an accepted edit a little."""
    privacy: bool
    """Sends `X-Rtrl-Privacy: 1`: nothing the developer writes is logged or trained on."""


def make_developer(seed: int, index: int, *, zh_share: float, privacy_share: float) -> Developer:
    """Developer number `index` of the population drawn from `seed`."""
    # One generator per developer, so a developer does not change with the population size.
    rng = random.Random(f"rtrl-simulator:{seed}:{index}")
    language: Language = "zh" if rng.random() < zh_share else "en"
    impatient = rng.random() < IMPATIENT_SHARE
    patience_s = rng.uniform(1.0, 2.0) if impatient else rng.uniform(2.0, 10.0)
    return Developer(
        user_id=f"sim-{seed}-{index:05d}",
        language=language,
        other_language_rate=round(rng.uniform(0.0, 0.2), 3),
        patience_s=round(patience_s, 2),
        think_time_s=round(rng.uniform(5.0, 60.0), 1),
        tweak_rate=round(rng.uniform(0.1, 0.5), 3),
        privacy=rng.random() < privacy_share,
    )


def make_population(
    size: int, seed: int, *, zh_share: float = 0.3, privacy_share: float = 0.1
) -> list[Developer]:
    """`size` developers, the same for the same seed and shares."""
    if size < 0:
        raise ValueError("a population cannot have a negative size")
    if not (0.0 <= zh_share <= 1.0 and 0.0 <= privacy_share <= 1.0):
        raise ValueError("zh_share and privacy_share are shares between 0 and 1")
    return [
        make_developer(seed, index, zh_share=zh_share, privacy_share=privacy_share)
        for index in range(size)
    ]
