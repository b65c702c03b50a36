"""The shipped Grafana dashboards work on real data: a real Prometheus (Debian's binary, on loopback)
scrapes a running ``specdec serve`` stack while requests flow, then every PromQL expression of every
panel, with the template variables substituted, must return data. A query that returns nothing fails.
The panels that traffic moves (request and token rates, acceptance, errors, batch size) must read above 0
after the traffic, and 0 (or nothing, or 0/0) before it: a panel that reads a pre-set 0 cannot pass.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gateway.openai.http_helpers import PROMPTS, openai_client, raw_client, serve
from tests.requirements import missing
from tests.service_processes import free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "helm" / "specdec" / "dashboards").glob("*.json"))
RATE_WINDOW = "20s"  # stands for Grafana's $__rate_interval (scrapes every 0.5 s here)


# (dashboard, panel title, refId) -> the least value a panel must show after the traffic (some series above it);
# before any traffic each of them reads 0, nothing, or NaN (0/0). Tokens/s and drafted tokens/s read 0 exactly.
MOVED_BY_TRAFFIC = {
    ("specdec-overview", "Requests finished per second", "A"): 0.0,
    ("specdec-overview", "Tokens per second", "A"): 0.0,
    ("specdec-overview", "Tokens per second", "B"): 0.0,
    ("specdec-overview", "Errors per second (by protocol and status)", "A"): 0.0,
    ("specdec-speculation", "Acceptance rate (accepted / drafted tokens)", "A"): 0.0,
    ("specdec-speculation", "Mean acceptance length (tokens per drafting round)", "A"): 1.0,
    ("specdec-speculation", "Draft vs accepted tokens per second", "A"): 0.0,
    ("specdec-speculation", "Draft vs accepted tokens per second", "B"): 0.0,
    ("specdec-speculation", "Batch size (mean calls per forward pass)", "A"): 0.0,
}
ZERO_BEFORE = {("specdec-overview", "Tokens per second", "A"), ("specdec-speculation", "Draft vs accepted tokens per second", "A")}


def _panels():
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                yield path.stem, panel["title"], target["refId"], target["expr"]


def test_dashboards_are_well_formed():
    assert [p.name for p in DASHBOARDS] == ["specdec-overview.json", "specdec-speculation.json"]
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        names = [v["name"] for v in board["templating"]["list"]]
        assert names == ["datasource", "model_name", "instance"], path.name
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in board["panels"])
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
    assert len(list(_panels())) >= 25
    exprs = " ".join(expr for *_, expr in _panels())
    for metric in ("specdec_kv_cache_usage_ratio", "specdec_kv_cache_free_blocks", "specdec_prefix_cache_queries_total",
                   "specdec_prefix_cache_hits_total", "specdec_num_preemptions_total"):
        assert metric in exprs, f"no panel shows {metric}"


def _prometheus_binary() -> str:
    import shutil

    exe = shutil.which("prometheus")
    if exe is None:
        missing("prometheus is not installed: apt-get install prometheus")
    return exe


@pytest.fixture(scope="module")
def prometheus_over_stack(target_dir, good_draft_dir, tmp_path_factory):
    stack = serve(target_dir, good_draft_dir)
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
        "scrape_configs:\n  - job_name: specdec\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{stack.gateway.http_port}']\n")
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([_prometheus_binary(), f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield stack, f"http://127.0.0.1:{port}", work
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        stack.stop(0)


def _query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise AssertionError(f"Prometheus refused {expr}: {err.read().decode()}") from None
    assert body["status"] == "success", body
    return body["data"]["result"]


def _regex_value(value: str) -> str:
    """A template variable's value as Grafana puts it in a regex matcher inside a PromQL string."""
    return re.escape(value).replace("\\", "\\\\")


def _wait_for_scrapes(base: str, what: str, timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while True:
        try:
            if _query(base, what):
                return
        except OSError:
            pass  # not listening yet
        assert time.monotonic() < give_up, f"Prometheus never returned {what}"
        time.sleep(0.25)


def _load(stack, model: str, seconds: float) -> None:
    """Mixed traffic for ``seconds``: greedy and sampled, streamed, n > 1, and a few bad requests."""
    client = openai_client(stack)
    end = time.monotonic() + seconds

    def one(i: int) -> None:
        while time.monotonic() < end:
            if i == 0:
                client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
            elif i == 1:
                list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                               stream=True))
            else:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=12, temperature=0.7, n=2)

    def bad_request() -> None:
        with raw_client(stack) as raw:
            assert raw.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0}).status_code == 400

    # a counter's series appears with its first error, at 1: a rate needs a second one, scrapes later
    bad_request()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(one, range(3)))
    bad_request()
    client.close()


def _concrete(expr: str, model: str, instance: str) -> str:
    concrete = (expr.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", _regex_value(model))
                .replace("$instance", _regex_value(instance)))
    assert "$" not in concrete, concrete
    return concrete


def _numbers(result: list) -> list[float]:
    return [float(r["value"][1]) for r in result]


def test_traffic_panels_are_known():
    """Every panel the traffic checks name exists (a renamed panel would otherwise drop out of the check)."""
    assert set(MOVED_BY_TRAFFIC) <= {(board, title, ref) for board, title, ref, _ in _panels()}
    assert ZERO_BEFORE <= set(MOVED_BY_TRAFFIC)


@pytest.mark.heavy
def test_every_panel_query_returns_data(prometheus_over_stack, target_dir):
    stack, base, work = prometheus_over_stack
    model = str(target_dir)
    _wait_for_scrapes(base, 'up{job="specdec"} == 1')
    # the negative control: enough scrapes for a rate, before any request
    _wait_for_scrapes(base, f'count_over_time(up{{job="specdec"}}[{RATE_WINDOW}]) >= 4')
    (instance,) = {r["metric"]["instance"] for r in _query(base, "specdec_build_info")}
    exprs = {(board, title, ref): expr for board, title, ref, expr in _panels()}
    before = {key: _numbers(_query(base, _concrete(exprs[key], model, instance))) for key in MOVED_BY_TRAFFIC}
    for key, numbers in before.items():
        assert all(v == 0 or math.isnan(v) for v in numbers), f"{key} reads {numbers} before any request"
    for key in ZERO_BEFORE:
        assert before[key] == [0.0], f"{key} should read 0 before any request (its counters start at 0): {before[key]}"
    _load(stack, model, seconds=6.0)
    _wait_for_scrapes(base, "specdec_request_errors_total")
    time.sleep(1.5)  # a few scrapes after the load: every rate window holds its samples
    values = {}
    empty = []
    for board, title, ref, expr in _panels():
        concrete = _concrete(expr, model, instance)
        result = _query(base, concrete)
        if not result:
            empty.append(f"{board} / {title} / {ref}: {concrete}")
            continue
        values[f"{board} / {title} / {ref}"] = [(r["metric"], r["value"][1]) for r in result]
        least = MOVED_BY_TRAFFIC.get((board, title, ref))
        if least is not None:
            numbers = _numbers(result)
            assert any(math.isfinite(v) and v > least for v in numbers), \
                f"{board} / {title} / {ref} reads {numbers} after the traffic, none above {least}: {concrete}"
    (work / "panel-values.json").write_text(json.dumps(values, indent=1))
    print("\n".join(f"{k}: {v}" for k, v in values.items()))
    assert not empty, "dashboard queries that return nothing:\n" + "\n".join(empty)
    accepted = _numbers(_query(base, _concrete(exprs[("specdec-speculation", "Acceptance rate (accepted / drafted "
                                                     "tokens)", "A")], model, instance)))
    assert all(0 < v <= 1 for v in accepted), accepted  # a rate of acceptance, with a good draft
