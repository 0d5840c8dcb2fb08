"""The Grafana dashboard (deployments/grafana/genrec.json): a dashboard Grafana loads (every panel queries the
templated Prometheus datasource), and every series it queries is one genrec exports. Without Ray here: the names are
checked against the sources; the check against a running app's metrics endpoint, with the labels the panels filter
on, is in tests/test_serving_funnel.py (its apps have a retriever and a ranker) and uses the helpers below."""

import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deployments" / "grafana" / "genrec.json"
DATASOURCE = "${datasource}"
# A metric in a PromQL expression, with its label matchers if it has any: ray_genrec_x{a="1",b=~"$B"}.
SELECTOR = re.compile(r"\b(ray_genrec_\w+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"')
ANY_RAY_METRIC = re.compile(r"\bray_\w+")
HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")
# What Ray's exporter adds to a series' name: a counter's _total, a histogram's samples.
EXPORT_SUFFIXES = ("_total", *HISTOGRAM_SAMPLES)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """The panels that show data: rows left out, a collapsed row's own panels in."""
    found = []
    for panel in board["panels"]:
        found.extend(panels(panel) if panel.get("type") == "row" else [panel])
    return found


def expressions(board: dict) -> list[str]:
    return [target["expr"] for panel in panels(board) for target in panel["targets"]]


def dashboard_series(board: dict | None = None) -> dict[str, set[str]]:
    """Each series the dashboard queries -> the labels its panels filter on (a series missing one of them would
    be filtered out of the panel)."""
    wanted: dict[str, set[str]] = {}
    for expr in expressions(board or dashboard()):
        for name, matchers in SELECTOR.findall(expr):
            wanted.setdefault(name, set()).update(MATCHER.findall(matchers))
    return wanted


def exported_series(text: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """From a Prometheus text exposition: (each sample name -> the label names its series carry, each metric's
    declared type from its `# TYPE` line)."""
    samples: dict[str, set[str]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split()[0]
            labels = set(re.findall(r'(\w+)="', rest.rsplit("}", 1)[0])) if rest else set()
            samples.setdefault(name, set()).update(labels)
    return samples, types


def missing_series(wanted: dict[str, set[str]], text: str) -> list[str]:
    """What the dashboard queries that the exposition `text` lacks: a series, a label a panel filters on, or a
    histogram's sample whose metric is not a histogram. Empty: every panel has its data."""
    samples, types = exported_series(text)
    gaps = []
    for name, labels in sorted(wanted.items()):
        if name not in samples:
            gaps.append(f"{name}: not exported")
            continue
        if labels - samples[name]:
            gaps.append(f"{name}: no label {sorted(labels - samples[name])}")
        base = _histogram_of(name)
        if base is not None and types.get(base) != "histogram":
            gaps.append(f"{name}: {base} is a {types.get(base)}, not a histogram")
    return gaps


def _histogram_of(name: str) -> str | None:
    """The histogram a `_bucket`, `_sum` or `_count` sample belongs to (None: not such a sample)."""
    for suffix in HISTOGRAM_SAMPLES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def metric_name(series: str) -> str:
    """The name genrec gives a metric (`genrec_...`) for a series Ray exports (`ray_genrec_..._total`)."""
    name = series.removeprefix("ray_")
    for suffix in EXPORT_SUFFIXES:
        if name.endswith(suffix) and _created(name.removesuffix(suffix)):
            return name.removesuffix(suffix)
    return name


def _created(name: str) -> bool:
    return f'"{name}"' in _metric_sources()


@functools.cache
def _metric_sources() -> str:
    """The sources that create genrec's metrics (each name appears there quoted)."""
    return "\n".join(path.read_text() for path in (ROOT / "platform" / "genrec").rglob("metrics.py"))


# -- the dashboard, without Ray ----------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_model_over_a_templated_prometheus():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 27
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == DATASOURCE, variable["name"]
    used = {v for expr in expressions(board) for v in re.findall(r"\$(\w+)", expr)} - {"__rate_interval"}
    assert used <= set(variables), used - set(variables)


def test_every_panel_has_a_target_on_the_templated_datasource():
    shown = panels(dashboard())
    assert len({p["id"] for p in dashboard()["panels"]}) == len(dashboard()["panels"])
    for panel in shown:
        assert panel["targets"] and panel["title"] and panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == DATASOURCE, panel["title"]


def test_every_expression_queries_genrec_series_only():
    """Each target reads at least one genrec series and no other Ray series, so the check against a running app
    covers every panel."""
    for expr in expressions(dashboard()):
        names = set(ANY_RAY_METRIC.findall(expr))
        assert names and all(n.startswith("ray_genrec_") for n in names), expr


def test_every_series_is_one_genrec_creates():
    """Fast feedback before the running-app check: each name the dashboard queries is created in a metrics module
    (serving/, engine/, cache/), once Ray's prefix and its _total/_bucket/_sum/_count are taken off."""
    unknown = [s for s in dashboard_series() if not _created(metric_name(s))]
    assert not unknown


def test_the_exposition_parser_reads_names_labels_and_types():
    text = "\n".join(
        [
            "# TYPE ray_genrec_request_latency_s histogram",
            'ray_genrec_request_latency_s_bucket{SessionName="s",application="a",kind="retrieve",le="0.1"} 3.0',
            "# TYPE ray_genrec_queue_depth gauge",
            'ray_genrec_queue_depth{SessionName="s",route="/v1/x,y"} 0.0',
            "ray_genrec_bare 1.0",
            "# TYPE ray_genrec_odd gauge",
            "ray_genrec_odd_bucket 1.0",
        ]
    )
    samples, types = exported_series(text)
    assert samples["ray_genrec_request_latency_s_bucket"] == {"SessionName", "application", "kind", "le"}
    assert samples["ray_genrec_queue_depth"] == {"SessionName", "route"} and samples["ray_genrec_bare"] == set()
    wanted = {
        "ray_genrec_request_latency_s_bucket": {"application"},
        "ray_genrec_queue_depth": {"application"},
        "ray_genrec_queue_depth_sum": set(),
        "ray_genrec_gone": set(),
        "ray_genrec_odd_bucket": set(),
    }
    assert missing_series(wanted, text) == [
        "ray_genrec_gone: not exported",
        "ray_genrec_odd_bucket: ray_genrec_odd is a gauge, not a histogram",
        "ray_genrec_queue_depth: no label ['application']",
        "ray_genrec_queue_depth_sum: not exported",
    ]
