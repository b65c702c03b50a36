"""Reading Prometheus metrics in tests: scrape a /metrics endpoint into {(name, labels): value}, and lint
an exposition with promtool (Debian's prometheus package; CI installs it)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.requirements import missing

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def scrape(url: str) -> tuple[str, Samples]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return text, parse(text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        missing("promtool is not installed: apt-get install prometheus")
    return exe


def promtool_problems(exposition: str) -> str:
    """What ``promtool check metrics`` says of an exposition (empty: clean)."""
    result = subprocess.run([promtool(), "check", "metrics"], input=exposition, capture_output=True, text=True,
                            timeout=60)
    return (result.stdout + result.stderr).strip() if result.returncode or result.stdout or result.stderr else ""
