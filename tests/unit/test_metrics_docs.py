"""The metrics table in docs/operations.md, the metrics the code declares, and the Grafana
dashboard built on them: the same names, in all three places."""

from __future__ import annotations

import json
import re
from pathlib import Path

from shoal.services.gateway.worker_metrics import WORKER_METRICS

REPO_ROOT = Path(__file__).resolve().parents[2]
DECLARED = re.compile(r"\.(?:counter|gauge|histogram)\(\s*\"(shoal_[a-z_]+)\"")
SERIES_SUFFIXES = ("_bucket", "_count", "_sum")


def documented() -> dict[str, str]:
    """Metric -> type, from the table under "### Metrics" in docs/operations.md."""
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Metrics", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(shoal_[a-z_]+)` \| (\w+) \|", section, re.MULTILINE)
    assert rows, "the metrics table is missing"
    return dict(rows)


def declared_in_code() -> set[str]:
    names = {spec.name for spec in WORKER_METRICS}
    for folder in ("services", "shared", "cli"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            names |= set(DECLARED.findall(path.read_text()))
    return names


def test_the_table_documents_every_metric_the_code_declares_and_no_other() -> None:
    assert set(documented()) == declared_in_code()


def test_worker_metric_types_match_the_table() -> None:
    table = documented()
    assert {spec.name: spec.kind for spec in WORKER_METRICS} == {n: table[n] for n in table if n.startswith("shoal_worker_")}


def test_the_grafana_dashboard_uses_only_documented_metrics_and_shows_every_one() -> None:
    dashboard = json.loads((REPO_ROOT / "docs" / "grafana" / "dashboards" / "shoal.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    used = set()
    for expr in exprs:
        for name in re.findall(r"shoal_[a-z_]+", expr):
            for suffix in SERIES_SUFFIXES:
                if name.endswith(suffix) and name.removesuffix(suffix) in documented():
                    name = name.removesuffix(suffix)
            used.add(name)
    assert used <= set(documented()), used - set(documented())
    assert used == set(documented()), f"not on the dashboard: {set(documented()) - used}"
