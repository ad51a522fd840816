"""deploy/dashboards/kvhal.json: every metric a panel's query names is one an engine's
``/metrics`` served in the end-to-end server test's scrape (tests/data/metrics_seen.txt,
kept current by that test), so a renamed or missing metric fails here, without a server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "dashboards" / "kvhal.json"
SEEN = ROOT / "tests" / "data" / "metrics_seen.txt"

#: PromQL words that are not metric names where they stand bare (not before "(").
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not a function or
    an aggregation (before "("), a keyword, a label (in "{...}" or a grouping's "(...)"), a
    string, a duration (in "[...]") or a number; Grafana's $variables removed first."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values, regexes
    text = re.sub(r"\$\{?\w+\}?", "", text)  # $__rate_interval, ${datasource}
    text = re.sub(r"\{[^{}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", "", text)  # ranges and subqueries' durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r"\1", text)
    names = set()
    for match in IDENT.finditer(text):
        word, rest = match.group(), text[match.end() :].lstrip()
        before = text[: match.start()]
        if rest.startswith("(") or re.match(r"(by|without)\b", rest):
            continue  # a function or an aggregation ("sum by (tier) (...)")
        if word in KEYWORDS or re.search(r"[0-9.]$", before):
            continue  # a keyword, or a number's exponent ("1e-9")
        names.add(word)
    return names


def queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every panel's targets and every query variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            found.append((f"${var['name']}", inner.group(1) if inner else query))
    return found


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (tier) (rate(vllm:kvhal_tier_hit_tokens_total{model_name=~"$m"}[5m]))',
            {"vllm:kvhal_tier_hit_tokens_total"},
        ),
        ("a / ignoring(tier) group_left sum(b)", {"a", "b"}),
        ("histogram_quantile(0.99, sum by (le, tier) (rate(x_bucket[$__rate_interval])))", {"x_bucket"}),
        ("clamp_min(sum(rate(y_count[1m])), 1e-9) and on(job) up", {"y_count", "up"}),
        ('min by (tier) (z{tier="disk", state=~"up|down"}) offset 5m', {"z"}),
    ],
)
def test_the_parser_finds_exactly_the_metric_names(expr, names):
    assert metric_names(expr) == names


def test_every_query_names_only_metrics_the_server_served():
    seen = set(SEEN.read_text().split())
    assert "vllm:kvhal_hit_tokens_total" in seen, "not a scrape of a kvhal engine"
    named = {}
    for title, expr in queries():
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        for name in names:
            named.setdefault(name, title)
    unseen = {name: title for name, title in named.items() if name not in seen}
    assert not unseen, f"queries name metrics /metrics did not serve: {unseen}"
    # the panels: hit ratio, TTFT, latency, occupancy, health, failures
    assert {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:kvhal_tier_up",
        "vllm:kvhal_tier_read_seconds_bucket",
    } <= set(named)


def test_a_query_naming_an_unserved_metric_fails():
    """The negative control: a misspelt family is caught."""
    seen = set(SEEN.read_text().split())
    assert metric_names("sum(rate(vllm:kvhal_tier_hit_token_total[5m]))") - seen == {
        "vllm:kvhal_tier_hit_token_total"
    }
