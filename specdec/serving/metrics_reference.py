"""The metrics reference of the docs (docs/observability/metrics.md), made from the metrics themselves: every
``specdec_`` family registered by :mod:`specdec.serving.metrics`, with the name it is scraped under, its type,
labels and help text. ``scripts/mkdocs_hooks.py`` writes it into the page at build time, so the reference
cannot drift from the code."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from specdec.serving import metrics as _metrics  # noqa: F401 - registers every family

# the suffix each type's samples carry in the exposition (prometheus-client's naming)
_SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@dataclass(frozen=True)
class MetricDoc:
    name: str  # the family's name (a counter's without ``_total``)
    type: str
    labels: tuple[str, ...]
    help: str

    @property
    def scraped_as(self) -> list[str]:
        return [self.name + suffix for suffix in _SERIES.get(self.type, ("",))]


def metric_docs(prefix: str = "specdec_") -> list[MetricDoc]:
    """Every registered family whose name starts with ``prefix``, in the order the code defines them."""
    out: dict[str, MetricDoc] = {}
    for collector in list(REGISTRY._collector_to_names):  # prometheus-client keeps no public list
        if isinstance(collector, MetricWrapperBase):
            families, labels = collector.describe(), tuple(collector._labelnames)
        elif hasattr(collector, "describe"):
            families, labels = collector.describe(), None
        else:
            continue
        for family in families:
            if family.name.startswith(prefix) and family.name not in out:
                names = labels if labels is not None else tuple(getattr(family, "_labelnames", ()))
                out[family.name] = MetricDoc(family.name, family.type, names, " ".join(family.documentation.split()))
    return list(out.values())


def markdown(prefix: str = "specdec_") -> str:
    """A Markdown table of :func:`metric_docs`."""
    rows = ["| series | type | labels | what |", "|---|---|---|---|"]
    for m in metric_docs(prefix):
        series = f"`{m.scraped_as[0]}`" if len(m.scraped_as) == 1 else \
            f"`{m.name}` (`{'`, `'.join(s[len(m.name):] for s in m.scraped_as)}`)"
        labels = ", ".join(f"`{label}`" for label in m.labels)
        rows.append(f"| {series} | {m.type} | {labels} | {m.help.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"
