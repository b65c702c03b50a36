"""The metrics reference (docs/observability/metrics.md, written at build time) lists exactly what a scrape
exposes: every ``specdec_`` family's TYPE line in the exposition has a row, and no row names something else."""

from __future__ import annotations

import re

from specdec.serving.metrics import exposition
from specdec.serving.metrics_reference import markdown, metric_docs


def test_the_reference_lists_every_exposed_family():
    text = exposition().decode()
    exposed = dict(re.findall(r"^# TYPE (specdec_\w+) (\w+)$", text, re.M))
    documented = {name: m.type for m in metric_docs() for name in m.scraped_as}
    for name, kind in exposed.items():
        series = name if kind != "histogram" else name + "_count"
        assert series in documented or name in documented, f"{name} ({kind}) is exposed but not in the reference"
    families = {m.name for m in metric_docs()}
    for name in families:
        assert any(e == name or e == name + "_total" for e in exposed), f"{name} is documented but not exposed"
    assert len(families) == len(exposed) > 30


def test_the_table_has_a_row_per_family_with_its_help():
    table = markdown().splitlines()
    docs = metric_docs()
    assert len(table) == 2 + len(docs)
    for row, m in zip(table[2:], docs):
        assert f"`{m.scraped_as[0] if m.type != 'histogram' else m.name}`" in row and m.type in row
        assert m.help and m.help.replace("|", "&#124;") in row
        assert all(f"`{label}`" in row for label in m.labels)
    counters = [m for m in docs if m.type == "counter"]
    assert counters and all(m.scraped_as == [m.name + "_total"] for m in counters)
