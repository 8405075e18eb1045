"""The simulated developers: deterministic from a seed, with the configured mix."""

from __future__ import annotations

import re

import pytest

from sandbox.simulator.population import make_population


def test_the_same_seed_gives_the_same_developers() -> None:
    assert make_population(50, seed=3) == make_population(50, seed=3)
    assert make_population(50, seed=3) != make_population(50, seed=4)


def test_a_developer_does_not_change_with_the_population_size() -> None:
    assert make_population(5, seed=3) == make_population(40, seed=3)[:5]


def test_user_ids_are_stable_unique_and_valid_headers() -> None:
    developers = make_population(200, seed=9)
    ids = [developer.user_id for developer in developers]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[A-Za-z0-9._:@-]{1,256}", user_id) for user_id in ids)
    assert ids[0] == "sim-9-00000"


def test_language_and_privacy_follow_the_configured_shares() -> None:
    developers = make_population(2000, seed=1, zh_share=0.3, privacy_share=0.1)
    zh = sum(developer.language == "zh" for developer in developers) / len(developers)
    private = sum(developer.privacy for developer in developers) / len(developers)
    assert 0.25 < zh < 0.35
    assert 0.07 < private < 0.13
    assert not any(d.privacy for d in make_population(200, seed=1, privacy_share=0.0))
    assert all(d.language == "zh" for d in make_population(200, seed=1, zh_share=1.0))


def test_patience_varies_and_some_developers_are_impatient() -> None:
    patience = [developer.patience_s for developer in make_population(500, seed=2)]
    impatient = [p for p in patience if p < 2.0]
    assert 0.1 < len(impatient) / len(patience) < 0.3
    assert all(1.0 <= p <= 10.0 for p in patience) and max(patience) > 8.0


def test_shares_outside_zero_to_one_are_refused() -> None:
    with pytest.raises(ValueError):
        make_population(3, seed=0, privacy_share=1.5)
