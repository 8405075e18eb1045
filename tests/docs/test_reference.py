"""The generated reference pages (`docs/reference/`) say what the code says.

The first test fails, naming the stale pages, when a setting, command, flag, route or metric
changed without `make docs-reference`; the others show that each kind of change is caught.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import ModuleType

import pytest
import typer
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field, create_model

from app.config import Settings
from rtrl import reference
from rtrl.reference import Page, stale_pages


@pytest.fixture(scope="module")
def pages() -> dict[str, Page]:
    return {page.name: page for page in reference.generate()}


def test_the_checked_in_reference_pages_are_the_ones_the_code_generates(
    pages: dict[str, Page],
) -> None:
    stale = stale_pages(pages.values())
    assert not stale, (
        f"stale reference page(s): {', '.join(stale)}; "
        f"run `{reference.REFRESH_COMMAND}` (python -m rtrl.reference) and commit the result"
    )


def test_the_pages_do_not_depend_on_the_settings_of_the_machine_that_makes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RTRL_GATEWAY_PORT", "9999")
    monkeypatch.setenv("RTRL_MAX_COMPLETION_TOKENS", "77")
    monkeypatch.setenv("RTRL_TRAIN_SEED", "5")
    assert not stale_pages(reference.generate())
    assert os.environ["RTRL_GATEWAY_PORT"] == "9999"  # and the environment is left as it was


def _stale_with(pages: dict[str, Page], name: str, text: str) -> list[str]:
    changed = {**pages, name: Page(name, reference.HEADER + text)}
    return stale_pages(changed.values())


def test_a_new_setting_makes_the_settings_page_stale(pages: dict[str, Page]) -> None:
    extended = create_model(
        "ExtendedSettings",
        __base__=Settings,
        shiny_new_knob=(int, Field(default=7, ge=1)),
    )
    docs = {**reference.attribute_docs(Settings), "shiny_new_knob": "A knob nobody documented."}
    text = reference.render_settings([("Service settings (`RTRL_*`)", extended, docs)])

    assert "| `RTRL_SHINY_NEW_KNOB` | int (≥ 1) | `7` | A knob nobody documented. |" in text
    assert _stale_with(pages, "settings.md", text) == ["docs/reference/settings.md"]


def test_a_new_command_or_flag_makes_the_cli_page_stale(pages: dict[str, Page]) -> None:
    from rtrl.cli import cli

    root = typer.main.get_command(cli)
    extra = typer.Typer()

    @extra.command()
    def polish(
        shine: int = typer.Option(3, help="How much to shine."),
    ) -> None:
        """Polish every checkpoint."""

    group = copy.copy(root)
    group.commands = {**root.commands, "polish": typer.main.get_command(extra)}  # type: ignore[attr-defined]
    text = reference.render_cli(group, "rtrl")

    assert "## `rtrl polish`" in text and "Polish every checkpoint." in text
    assert "| `--shine` | int | `3` | How much to shine. |" in text
    assert _stale_with(pages, "cli.md", text) == ["docs/reference/cli.md"]


def test_a_new_route_makes_the_http_page_stale(pages: dict[str, Page]) -> None:
    from app.main import create_app

    schema = copy.deepcopy(create_app(Settings.model_validate({})).openapi())
    schema["paths"]["/admin/polish"] = {
        "post": {"summary": "Polish", "responses": {"204": {"description": "Polished"}}}
    }
    text = reference.render_http_api(schema)

    assert "## `POST /admin/polish`" in text
    assert _stale_with(pages, "http-api.md", text) == ["docs/reference/http-api.md"]


def test_a_new_metric_makes_the_metrics_page_stale(pages: dict[str, Page]) -> None:
    module = ModuleType("app.polish")
    module.POLISHED = Counter(  # type: ignore[attr-defined]
        "rtrl_polished", "Checkpoints polished.", ["checkpoint"], registry=CollectorRegistry()
    )
    modules = [*(__import__(name, fromlist=["_"]) for name in reference.metric_modules()), module]
    text = reference.render_metrics(reference.collect_metrics(modules))

    assert "| `rtrl_polished_total` | counter | `checkpoint` | Checkpoints polished. |" in text
    assert _stale_with(pages, "metrics.md", text) == ["docs/reference/metrics.md"]


def test_every_setting_command_and_metric_is_on_its_page(pages: dict[str, Page]) -> None:
    from trainer.config import TrainSettings

    for name in Settings.model_fields:
        assert f"`RTRL_{name.upper()}`" in pages["settings.md"].text
    for name in TrainSettings.model_fields:
        assert f"`RTRL_TRAIN_{name.upper()}`" in pages["settings.md"].text
    for command in ("rtrl demo", "rtrl services up", "rtrl train", "rtrl spool replay"):
        assert f"`{command}`" in pages["cli.md"].text
    assert "`POST /v1/chat/completions`" in pages["http-api.md"].text
    assert "`rtrl_kafka_connected`" in pages["metrics.md"].text
    assert "`rtrl_training_runs_total`" in pages["metrics.md"].text


def test_the_check_command_names_a_stale_page(tmp_path: Path) -> None:
    page = Page("settings.md", "fresh\n")
    (tmp_path / "settings.md").write_text("old\n")

    assert stale_pages([page], tmp_path) == [str(tmp_path / "settings.md")]
    reference.write([page], tmp_path)
    assert stale_pages([page], tmp_path) == []
