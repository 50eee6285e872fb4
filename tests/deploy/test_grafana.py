"""deploy/grafana/vbs-serve.json: a dashboard Grafana imports, whose every query reads series the
service really exports (names read from a real app's metrics registry), covering the figures
that matter: throughput, perf_analyzer's breakdown, p50/p99, memory, the plan, step-downs and
OOM retries."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.deploy.support import DEPLOY, exported_metric_names, promql_metrics

DASHBOARD = DEPLOY / "grafana" / "vbs-serve.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"]
             for t in p.get("targets", [])]
    found += [(f"variable {v['name']!r}", v["query"]["query"])
              for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_query_reads_series_the_service_exports(dashboard: dict[str, Any]) -> None:
    exported = exported_metric_names()
    assert {"vbs_samples_total", "vbs_request_latency_seconds_bucket", "vbs_queue_depth"} <= exported
    unknown = [(where, name) for where, expr in queries(dashboard)
               for name in sorted(promql_metrics(expr) - exported)]
    assert not unknown, f"queries name series vbs-serve does not export: {unknown}"
    assert all(promql_metrics(expr) for _, expr in queries(dashboard)), "a query reads nothing"


def test_the_figures_that_matter_are_there(dashboard: dict[str, Any]) -> None:
    read = set().union(*(promql_metrics(expr) for _, expr in queries(dashboard)))
    for series in ("vbs_samples_total",                                      # throughput
                   "vbs_request_latency_seconds_bucket",                     # p50 / p99
                   "vbs_queue_time_seconds_sum", "vbs_compute_input_seconds_sum",
                   "vbs_compute_infer_seconds_sum", "vbs_compute_output_seconds_sum",
                   "vbs_free_memory_bytes", "vbs_memory_lease_bytes",        # memory per model
                   "vbs_memory_share_bytes", "vbs_memory_budget_bytes",
                   "vbs_plan_peak_bytes", "vbs_table_version",               # the plan in use
                   "vbs_memory_step_downs_total", "vbs_oom_retries_total",
                   "vbs_queue_depth"):
        assert series in read, f"the dashboard does not show {series}"
    exprs = " ".join(expr for _, expr in queries(dashboard))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    assert "grpc_infer" in exprs, "latency covers gRPC inference too"


def test_it_is_a_dashboard_grafana_imports(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "vbs-serve" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "model"} <= variables
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel.get("description"), panel["title"]
