"""The Grafana dashboard (``dashboards/grafana.json``) reads series the server exports: every metric name its
queries use exists on a live server's ``/metrics`` (with the default models, after a chat and an embeddings
request), so a renamed series breaks this test, not the dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "grafana.json"
#: The samples a family of each type exports, by the suffix added to its name.
SUFFIXES = {"counter": ("", "_total"), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(text: str) -> set[str]:
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names.update(family + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def test_every_series_the_dashboard_queries_exists(client: OpenAI, server_url: str) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    client.embeddings.create(model="all-MiniLM-L6-v2", input="hi")
    names = exported(httpx.get(f"{server_url}/metrics").text)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries.append(dashboard["templating"]["list"][1]["definition"])
    used = {name for query in queries for name in re.findall(r"smolserve:[a-z0-9_]+", query)}
    assert len(used) >= 20
    assert used <= names, sorted(used - names)


def test_the_dashboard_is_importable_json_with_a_replica_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "smolserve" and len(dashboard["panels"]) >= 15
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["replica"]["includeAll"] and variables["replica"]["allValue"] == ".*"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
