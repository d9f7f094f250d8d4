"""The Prometheus alerting rules (docs/grafana/alerts.yml): valid, unit-tested case by case
with promtool (alerts_test.yml: each rule fires on its trouble and not on what only looks
alike), and built only on metrics Shoal exports and jobs the scrape config defines."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.unit.test_metrics_docs import REPO_ROOT, SERIES_SUFFIXES, documented

GRAFANA = REPO_ROOT / "docs" / "grafana"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                                              "prometheus; .ci/run installs it)")


def _rules() -> list[dict[str, object]]:
    groups = yaml.safe_load((GRAFANA / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=GRAFANA, capture_output=True, text=True, timeout=120, check=False)


@needs_promtool
def test_the_rules_and_the_scrape_config_that_loads_them_are_valid() -> None:
    checked = _promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0 and f"{len(_rules())} rules found" in checked.stdout, checked.stdout + checked.stderr


@needs_promtool
def test_every_rule_fires_on_its_trouble_and_only_then() -> None:
    tested = _promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = yaml.safe_load((GRAFANA / "alerts_test.yml").read_text())["tests"]
    firing = {expected["alertname"] for case in cases for expected in case["alert_rule_test"]
              if expected.get("exp_alerts")}
    assert firing == {rule["alert"] for rule in _rules()}, "every rule has a case where it fires"


def test_the_rules_use_only_exported_metrics_and_scraped_jobs() -> None:
    metrics = documented()
    jobs = {job["job_name"] for job in yaml.safe_load((GRAFANA / "prometheus.yml").read_text())["scrape_configs"]}
    for rule in _rules():
        expr = str(rule["expr"])
        for name in re.findall(r"shoal_[a-z_]+", expr):
            base = next((name.removesuffix(s) for s in SERIES_SUFFIXES if name.endswith(s)
                         and name.removesuffix(s) in metrics), name)
            assert base in metrics, (rule["alert"], name)
        assert set(re.findall(r'job="([^"]+)"', expr)) <= jobs, rule["alert"]
        labels = rule["labels"]
        assert isinstance(labels, dict) and labels["severity"] in ("page", "ticket"), rule["alert"]
