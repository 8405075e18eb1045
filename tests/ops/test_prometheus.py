"""ops/: the alert rules and scrape config load, the alerts fire on the series the product
exports, and every metric the rules and the dashboard read is one the product defines."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "ops" / "prometheus"
DASHBOARD = ROOT / "ops" / "grafana" / "rtrl.json"
COMPOSE = ROOT / "docker-compose.yml"

# Where the product defines its metrics: the gateway app, the workers, the trainer.
METRIC_MODULES = ("app.main", "workers.consumer", "trainer.metrics", "trainer.cycle")
# Series Prometheus makes itself.
PROMETHEUS_SERIES = {"up", "ALERTS", "ALERTS_FOR_STATE"}
# The suffixes prometheus_client exposes for each kind of metric.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool is not installed (`make test` installs Debian's prometheus)"
)


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert promtool is not None
    return subprocess.run(
        [promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
    )


@needs_promtool
def test_the_rules_and_the_scrape_config_load() -> None:
    rules = run_promtool("check", "rules", "alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = run_promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_the_alerts_fire_on_synthetic_series() -> None:
    """Spool growing, Kafka unreachable, lag, late rewards, a failed run, a rollback and a
    reward-hacking alert each fire when their series say so, and stay quiet otherwise."""
    result = run_promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def defined_metrics() -> set[str]:
    """Every series name the product's metrics can expose, labelled or not yet observed."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def selectors(node: Any) -> Iterator[str]:
    """The metric names a PromQL expression reads."""
    if isinstance(node, promql_parser.VectorSelector):
        name = node.name or next(
            (m.value for m in node.matchers.matchers if m.name == "__name__"), None
        )
        if name:
            yield name
    for attribute in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None and not isinstance(child, (str, int, float)):
            yield from selectors(child)
    for argument in getattr(node, "args", None) or []:
        yield from selectors(argument)


def rule_expressions() -> dict[str, str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def dashboard_expressions() -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        f"{panel['title']} [{target['refId']}]": target["expr"].replace("$__rate_interval", "5m")
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    }


def test_every_metric_in_the_rules_and_the_dashboard_is_one_the_product_defines() -> None:
    defined = defined_metrics() | PROMETHEUS_SERIES
    expressions = rule_expressions() | dashboard_expressions()
    used = {
        where: set(selectors(promql_parser.parse(expression)))
        for where, expression in expressions.items()
    }
    unknown = {where: sorted(names - defined) for where, names in used.items() if names - defined}
    assert unknown == {}
    assert all(used.values()), "an expression that reads no metric"
    # The alerts ops asked for read what the product exports.
    assert {
        "rtrl_spool_depth",
        "rtrl_kafka_connected",
        "rtrl_consumer_lag_messages",
        "rtrl_rewards_overdue_seconds",
        "rtrl_training_run_last_finished_timestamp_seconds",
        "rtrl_guardrail_rollbacks_total",
        "rtrl_reward_hacking_alerts_total",
    } <= set().union(*used.values())


def test_a_misspelled_metric_would_be_caught() -> None:
    names = set(selectors(promql_parser.parse("sum(rate(rtrl_spool_dept[5m])) > 0")))
    assert names == {"rtrl_spool_dept"}
    assert not names <= defined_metrics()


def test_prometheus_scrapes_each_process_where_compose_serves_its_metrics() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    targets = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.split(":")
                targets[job["job_name"]] = (host, int(port))
        for dns in job.get("dns_sd_configs", []):
            targets[job["job_name"]] = (dns["names"][0], int(dns["port"]))
    assert targets == {
        "rtrl-gateway": ("gateway", 8080),
        "rtrl-workers": ("workers", 9100),
        "rtrl-trainer": ("trainer", 9100),
    }
    for job, (service, port) in targets.items():
        if job == "rtrl-gateway":
            assert services[service]["command"][-1] == str(port)
        else:
            assert str(services[service]["environment"]["RTRL_METRICS_PORT"]) == str(port)
    mounts = " ".join(services["prometheus"]["volumes"] + services["grafana"]["volumes"])
    assert "./ops/prometheus" in mounts and "./ops/grafana" in mounts
