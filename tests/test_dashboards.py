"""The shipped Grafana dashboards work on real data: a real Prometheus (Debian's binary, on loopback)
scrapes a running ``specdec serve`` stack while requests flow, then every PromQL expression of every
panel, with the template variables substituted, must return data. A query that returns nothing fails.
"""

from __future__ import annotations

import json
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

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(one, range(3)))
    with raw_client(stack) as raw:
        assert raw.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0}).status_code == 400
    client.close()


def test_every_panel_query_returns_data(prometheus_over_stack, target_dir):
    stack, base, work = prometheus_over_stack
    model = str(target_dir)
    _wait_for_scrapes(base, 'up{job="specdec"} == 1')
    _load(stack, model, seconds=6.0)
    _wait_for_scrapes(base, "specdec_request_errors_total")
    time.sleep(1.5)  # a few scrapes after the load: every rate window holds its samples
    (instance,) = {r["metric"]["instance"] for r in _query(base, "specdec_build_info")}
    values = {}
    empty = []
    for board, title, ref, expr in _panels():
        concrete = (expr.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", _regex_value(model))
                    .replace("$instance", _regex_value(instance)))
        assert "$" not in concrete, concrete
        result = _query(base, concrete)
        if not result:
            empty.append(f"{board} / {title} / {ref}: {concrete}")
            continue
        values[f"{board} / {title} / {ref}"] = [(r["metric"], r["value"][1]) for r in result]
    (work / "panel-values.json").write_text(json.dumps(values, indent=1))
    print("\n".join(f"{k}: {v}" for k, v in values.items()))
    assert not empty, "dashboard queries that return nothing:\n" + "\n".join(empty)
