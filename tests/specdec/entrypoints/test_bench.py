"""``specdec bench`` against a running tiny stack (``specdec serve``'s servers, random-weight models): it runs,
prints the metrics, and its JSON has every field; plus the parts that need no server."""

from __future__ import annotations

import json
import sys

import pytest

from specdec.entrypoints import bench, cli
from tests.gateway.openai.http_helpers import KEY, base_url, serve

PERCENTILE_KEYS = {"mean", "p50", "p90", "p99"}


def assert_per_position(spec: dict, k: int) -> None:
    """Acceptance per draft position: counts that add up to the accepted tokens, never rising with the position
    (a round accepts a prefix of its proposal), and their rates over the drafting rounds."""
    counts, rates = spec["num_accepted_tokens_per_pos"], spec["acceptance_rate_per_pos"]
    assert 0 < len(counts) <= k and sum(counts) == spec["num_accepted_tokens"], spec
    assert all(a >= b for a, b in zip(counts, counts[1:])), counts
    assert rates == pytest.approx([c / spec["num_drafts"] for c in counts]) and all(0 <= r <= 1 for r in rates)


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000, (path, len(data))  # a real figure, not an empty one


@pytest.fixture(scope="module")
def stack(target_dir, good_draft_dir):
    s = serve(target_dir, good_draft_dir, k=2)
    yield s
    s.stop(grace=0)


def _bench(capsys, stack, *argv) -> str:
    assert cli.main(["bench", "--base-url", base_url(stack), "--api-key", KEY, "--no-progress", *argv]) == 0
    return capsys.readouterr().out


def test_bench_json_has_every_field(stack, capsys):
    out = json.loads(_bench(capsys, stack, "--num-prompts", "6", "--max-tokens", "8", "--concurrency", "3",
                            "--ignore-eos", "--json"))
    assert (out["completed"], out["failed"], out["errors"]) == (6, 0, [])
    assert out["total_output_tokens"] == 6 * 8 and out["total_input_tokens"] > 0
    assert out["request_throughput"] > 0 and out["output_throughput"] > out["request_throughput"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(out[key]) == PERCENTILE_KEYS, key
        assert 0 < out[key]["p50"] <= out[key]["p90"] <= out[key]["p99"], (key, out[key])
    assert out["e2e_ms"]["p50"] >= out["ttft_ms"]["p50"]
    spec = out["spec_decode"]
    assert spec["source"] == "metrics" and spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
    assert 0 <= spec["acceptance_rate"] <= 1 and 1 <= spec["mean_acceptance_length"] <= 3  # k=2
    assert_per_position(spec, k=2)
    assert out["config"]["concurrency"] == 3 and out["config"]["request_rate"] == "inf"
    assert "api_key" not in out["config"]


def test_bench_text_report_from_a_jsonl_dataset_at_a_rate(stack, capsys, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Once upon a time", "def add(a, b):")) + "\n")
    result = tmp_path / "result.json"
    text = _bench(capsys, stack, "--dataset", str(data), "--num-prompts", "3", "--max-tokens", "4",
                  "--request-rate", "50", "--no-metrics", "--out", str(result))
    for line in ("Successful requests", "Request throughput (req/s)", "Output token throughput (tok/s)",
                 "Time to First Token", "Inter-token Latency", "End-to-end Latency", "P99 (ms)", "Acceptance rate",
                 "Acceptance rate, position 1"):
        assert line in text, line
    saved = json.loads(result.read_text())
    assert saved["completed"] == 3 and saved["spec_decode"]["source"] == "usage"
    assert saved["spec_decode"]["num_draft_tokens"] > 0
    assert_per_position(saved["spec_decode"], k=2)  # summed from the responses' usage.spec_decode
    assert_png(tmp_path / "result.png")  # beside the JSON: latency percentiles, acceptance per position


def test_bench_no_plot_and_no_matplotlib(stack, capsys, tmp_path, monkeypatch):
    argv = ("--num-prompts", "1", "--max-tokens", "4", "--json")
    _bench(capsys, stack, *argv, "--no-plot", "--out", str(tmp_path / "a.json"))
    assert (tmp_path / "a.json").is_file() and not (tmp_path / "a.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    assert cli.main(["bench", "--base-url", base_url(stack), "--api-key", KEY, "--no-progress", *argv,
                     "--out", str(tmp_path / "b.json")]) == 0  # the benchmark stands without its plot
    captured = capsys.readouterr()
    assert json.loads(captured.out)["completed"] == 1 and (tmp_path / "b.json").is_file()
    assert not (tmp_path / "b.png").exists()
    assert "no plot written" in captured.err and "pip install 'specdec[bench]'" in captured.err  # the CLI's log


def test_bench_chat_dataset_and_a_wrong_key(stack, capsys):
    out = json.loads(_bench(capsys, stack, "--dataset", "mixed", "--num-prompts", "2", "--max-tokens", "4", "--json"))
    assert out["config"]["endpoint"] == "chat" and out["completed"] == 2
    assert cli.main(["bench", "--base-url", base_url(stack), "--api-key", "wrong", "--model", "m", "--no-progress",
                     "--num-prompts", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == 1 and "HTTP 401" in out["errors"][0]


def test_bench_over_grpc(stack, capsys):
    out = json.loads(_bench(capsys, stack, "--endpoint", "grpc", "--grpc-addr", f"127.0.0.1:{stack.gateway.port}",
                            "--num-prompts", "4", "--max-tokens", "6", "--ignore-eos", "--concurrency", "2",
                            "--no-metrics", "--json"))
    assert (out["completed"], out["total_output_tokens"], out["config"]["endpoint"]) == (4, 24, "grpc")
    assert out["ttft_ms"]["p50"] > 0 and out["spec_decode"]["source"] == "usage"
    assert out["spec_decode"]["num_draft_tokens"] > 0


def test_bench_says_when_no_server_answers():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(SystemExit, match="cannot list the models of .* is the server up"):
        cli.main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress"])


def test_percentiles_and_counters():
    p = bench.percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01) and p["mean"] == pytest.approx(50.5)
    assert bench.percentiles([]) == dict.fromkeys(PERCENTILE_KEYS, 0.0)
    text = ("# TYPE specdec_spec_decode_num_drafts_total counter\n"
            'specdec_spec_decode_num_drafts_total{model_name="a",service="gateway"} 3.0\n'
            'specdec_spec_decode_num_drafts_total{model_name="b",service="gateway"} 2.0\n'
            'specdec_spec_decode_num_drafts_created{model_name="a"} 1.7e9\n'
            "specdec_spec_decode_num_draft_tokens_total 9.0\n")
    assert bench.spec_counters(text) == {"num_drafts": 5.0, "num_draft_tokens": 9.0, "num_accepted_tokens": 0.0}
    per_pos = ('specdec_spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="1",service="g"} 2.0\n'
               'specdec_spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0",service="g"} 4.0\n'
               'specdec_spec_decode_num_accepted_tokens_per_pos_total{model_name="b",position="0",service="g"} 1.0\n'
               'specdec_spec_decode_num_accepted_tokens_per_pos_created{model_name="a",position="0"} 1.7e9\n')
    assert bench.accepted_per_pos(text + per_pos) == [5.0, 2.0] and bench.accepted_per_pos(text) == []


def test_bench_imports_no_torch_grpc_or_matplotlib():
    import subprocess
    import sys

    code = "import sys, specdec.entrypoints.bench; print(sorted({'torch', 'grpc', 'matplotlib'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_builtin_datasets_load():
    for name in bench.DATASETS:
        prompts, endpoint = bench.load_dataset(name)
        assert prompts and all(isinstance(p, str) and p for p in prompts) and endpoint in ("chat", "completions")
    with pytest.raises(SystemExit, match="neither a built-in set"):
        bench.load_dataset("no-such-set")


def test_per_position_acceptance_counts_this_run_only():
    """A server that drafted further before this run (another benchmark at a larger k) keeps those positions'
    counters: their deltas are 0 and are left out, so the per-position list is as long as this run's drafts."""
    before = {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 12.0,
              bench.PER_POS: [6.0, 3.0, 2.0, 1.0]}
    after = {"num_drafts": 14.0, "num_draft_tokens": 48.0, "num_accepted_tokens": 17.0,
             bench.PER_POS: [10.0, 4.0, 2.0, 1.0]}
    result = bench.RequestResult(ok=True, output_tokens=8, prompt_tokens=3)
    out = bench.summarize(bench.BenchConfig(), "m", "completions", [result], 1.0, before, after)
    spec = out["spec_decode"]
    assert spec[bench.PER_POS] == [4, 1] and spec["acceptance_rate_per_pos"] == pytest.approx([1.0, 0.25])
    assert_per_position(spec, k=2)
