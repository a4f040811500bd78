"""The Grafana dashboard, built in code with the Grafana foundation SDK from the queries in
specdec_tools/promql.py. `specdec grafana dashboard` writes it to cluster/grafana/ (committed;
a test checks the file is what this code builds) and `specdec grafana provision` uploads it."""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from specdec_tools.promql import PANELS

UID = "specdec-serve"
DATASOURCE_UID = "specdec-prometheus"  # the data source `grafana provision` creates
_DS = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)


def _variable(name: str, query: str, label: str) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(label).datasource(_DS).query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True)
            .all_value(".*").multi(True))


def build() -> dict:
    d = (dashboard.Dashboard("specdec-serve: speculative decoding").uid(UID)
         .tags(["specdec", "ray-serve", "llm"]).refresh("10s").time("now-30m", "now")
         .with_variable(_variable("application", "label_values(ray_specdec_requests_total, "
                                  "application)", "Application"))
         .with_variable(_variable("replica", 'label_values(ray_specdec_running_requests'
                                  '{application=~"$application"}, replica)', "Replica")))
    for i, spec in enumerate(PANELS):
        panel = (stat.Panel() if spec.kind == "stat" else timeseries.Panel())
        panel = panel.title(spec.title).description(spec.description).unit(spec.unit) \
            .datasource(_DS).grid_pos(_grid(i))
        for j, q in enumerate(spec.queries):
            panel = panel.with_target(prometheus.Dataquery().expr(q.expr)
                                      .legend_format(q.legend).ref_id(chr(ord("A") + j)))
        d = d.with_panel(panel)
    out = json.loads(JSONEncoder(sort_keys=True).encode(d.build()))
    for panel in out["panels"]:  # leave Grafana's own defaults where the SDK wrote null
        for key in [k for k, v in panel.items() if v is None]:
            del panel[key]
    return out


def _grid(i: int):
    from grafana_foundation_sdk.models.dashboard import GridPos

    return GridPos(h=8, w=12, x=12 * (i % 2), y=8 * (i // 2))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"
