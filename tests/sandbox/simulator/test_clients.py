"""Which client a simulated developer's IDE is, and the habits that decide what it reports."""

from __future__ import annotations

import pytest

from sandbox.simulator.clients import ClientConfig, ide_for_session
from sandbox.simulator.population import make_population

DEVELOPERS = make_population(400, seed=3)


def test_a_developer_keeps_their_ide_habits_from_one_session_to_the_next() -> None:
    config = ClientConfig(mode="continue", ide_closes_share=0.5)
    for developer in DEVELOPERS[:20]:
        first, second = (ide_for_session(config, developer, n) for n in (0, 1))
        assert first.destination == second.destination
        assert first.closes_early == second.closes_early
        assert first.new_chat_session() != second.new_chat_session()


def test_the_shares_of_habits_follow_the_config() -> None:
    config = ClientConfig(
        mode="continue", ide_closes_share=0.3, nocode_share=0.2, old_schema_share=0.1
    )
    ides = [ide_for_session(config, developer, 0) for developer in DEVELOPERS]
    assert 0.2 < sum(ide.closes_early for ide in ides) / len(ides) < 0.4
    assert 0.12 < sum(ide.destination.level == "noCode" for ide in ides) / len(ides) < 0.28
    assert 0.05 < sum(ide.destination.schema == "0.1.0" for ide in ides) / len(ides) < 0.15
    looks = [ide.looks_at_edit() for ide in ides for _ in range(5)]
    assert 0.63 < sum(looks) / len(looks) < 0.77


def test_the_default_client_is_the_ideal_one_and_nobody_closes_the_ide_early() -> None:
    config = ClientConfig()
    assert config.mode == "ideal"
    assert not any(ide_for_session(config, d, 0).closes_early for d in DEVELOPERS)


@pytest.mark.parametrize(
    "knobs",
    [
        {"mode": "zed"},
        {"ide_closes_share": 1.5},
        {"unlooked_edit_share": -0.1},
        {"approves_failing": 2},
    ],
)
def test_a_client_config_with_impossible_knobs_is_refused(knobs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ClientConfig(**knobs)  # type: ignore[arg-type]
