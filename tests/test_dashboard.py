"""The Grafana dashboard (``deploy/grafana/mooncake-vllm.json``) against a running pair and proxy:
every series a panel queries exists on the ``/metrics`` of the shared cluster's prefill or
decode or of a proxy in front of them, and every label a panel groups by is on that series'
samples, so a renamed metric or label fails here, not on an operator's screen."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.pd import complete, greedy_body

pytestmark = pytest.mark.servers

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "mooncake-vllm.json"
SERIES = re.compile(r"\b((?:vllm:|mooncake_proxy_)[A-Za-z0-9_:]+)")
GROUPED = re.compile(r"\bby \(([^)]*)\)")
SUFFIXES = ("_bucket", "_total", "_sum", "_count")


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def family_of(series: str) -> str:
    """The metric family a queried sample name belongs to (``x_bucket`` → ``x``)."""
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 10
    assert all(SERIES.search(expr) for _, expr in queries())


async def test_every_series_and_label_a_panel_queries_is_served(pd, http, start_proxy):
    proxy = await start_proxy(prefill=[pd.prefill.url], decode=[pd.decode.url])
    rng = random.Random(881)
    for n in (300, 700):  # a handover through the proxy: every labeled series has a sample
        prompt = [rng.randrange(3, 2048) for _ in range(n)]
        await complete(http, proxy, greedy_body(pd.model, prompt, 4))
    families: dict[str, set[str]] = {}
    for url in (pd.prefill.url, pd.decode.url, proxy):  # the proxy serves in this event loop
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            labels = families.setdefault(family.name, set())
            for sample in family.samples:
                labels.update(sample.labels)
    missing, unlabeled = [], []
    for title, expr in queries():
        grouped = {g.strip() for m in GROUPED.finditer(expr) for g in m.group(1).split(",")}
        grouped -= {"le", "instance"}  # Prometheus' own: the bucket bound, the scrape target
        for series in SERIES.findall(expr):
            family = family_of(series)
            if family not in families:
                missing.append((title, series))
            elif families[family] and not grouped <= families[family]:
                unlabeled.append((title, series, sorted(grouped - families[family])))
    assert not missing, f"panels query series no server serves: {missing}"
    assert not unlabeled, f"panels group by labels the series lack: {unlabeled}"
