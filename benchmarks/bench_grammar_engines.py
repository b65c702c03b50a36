"""The grammar engines structured outputs could use, side by side on this CPU: xgrammar (specdec's) and llguidance
(vLLM's other backend), over the target's tokenizer.

For each JSON schema (the extraction tasks of ``bench_structured.py``) and a reference answer that follows it,
each engine compiles the schema, then walks the answer token by token: the allowed-token mask of every position
(what a verify pass needs per row) and the advance over the token. Reported per engine: the tokenizer set-up, the
compile time, and the mask time per token (median, p90, max). Both engines must accept every reference answer.

    python benchmarks/bench_grammar_engines.py            # needs: pip install llguidance==1.9.1
    python benchmarks/bench_grammar_engines.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import TASKS  # noqa: E402
from common import add_common_args, cpu_info, json_path, print_table, report_checks, write_json  # noqa: E402

from specdec.config import DEFAULT_TARGET  # noqa: E402

COLUMNS = ["engine", "tokenizer s", "compile ms", "mask us median", "mask us p90", "mask us max", "accepted"]

ANSWERS = [
    {"name": "Ada Lovelace", "age": 36, "city": "London", "job": "mathematician"},
    {"order_id": 4411, "items": [{"name": "blue mug", "quantity": 2, "unit_price": 7.5},
                                 {"name": "teapot", "quantity": 1, "unit_price": 24.0}], "city": "Oslo"},
    {"date": "2026-03-14", "time": "10:30", "room": "B2", "topics": ["budget", "hiring"]},
    {"rating": 4, "sentiment": "mixed", "pros": "great sound", "cons": "short battery life"},
    {"name": "get_weather", "arguments": {"city": "Paris", "country": "France", "days": 3, "unit": "celsius"}},
    {"title": "Dune", "author": "Frank Herbert", "year": 1965, "publisher": "Chilton Books"},
    {"host": "web-3", "region": "eu-west", "cpu_percent": 93, "memory_percent": 71, "status": "degraded",
     "since": "04:10"},
    {"flight": "LH 1234", "from": "Frankfurt", "to": "Lisbon", "departure": "07:45", "gate": "A12",
     "boarding": "07:05"},
    {"dish": "pancakes", "ingredients": [{"item": "flour", "amount": "200 g"}, {"item": "eggs", "amount": "2"}]},
    {"title": "Save shows a blank screen", "component": "settings", "browser": "Firefox 128", "severity": "high"},
]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_xgrammar(tokenizer, vocab_size: int, cases) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    setup = time.perf_counter() - start
    compile_s, masks, accepted = [], [], True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    for schema, ids in cases:
        start = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        compile_s.append(time.perf_counter() - start)
        for t in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            masks.append(time.perf_counter() - start)
            accepted &= bool(matcher.accept_token(t))
    return {"setup": setup, "compile": compile_s, "masks": masks, "accepted": accepted}


def run_llguidance(tokenizer, vocab_size: int, cases) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - start
    compile_s, masks, accepted = [], [], True
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    for schema, ids in cases:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        compile_s.append(time.perf_counter() - start)
        accepted &= not matcher.get_error()
        for t in ids:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            masks.append(time.perf_counter() - start)
            accepted &= bool(matcher.consume_token(t))
    return {"setup": setup, "compile": compile_s, "masks": masks, "accepted": accepted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET, help="whose tokenizer and vocabulary")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "grammar_engines")
    cpu = cpu_info()
    from specdec.engine.models import load_model

    lm = load_model(args.target, dtype="float32")
    cases = [(schema, list(lm.tokenizer(json.dumps(answer)).input_ids))
             for (_, schema), answer in zip(TASKS, ANSWERS)][: 2 if args.smoke else None]
    results, rows = {}, []
    for name, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        try:
            results[name] = r = run(lm.tokenizer, lm.vocab_size, cases)
        except ImportError as exc:
            print(f"{name}: not installed ({exc}); pip install llguidance==1.9.1", file=sys.stderr)
            continue
        rows.append({"engine": name, "tokenizer s": r["setup"], "compile ms": 1000 * sum(r["compile"]) / len(r["compile"]),
                     "mask us median": 1e6 * _percentile(r["masks"], 0.5), "mask us p90": 1e6 * _percentile(r["masks"], 0.9),
                     "mask us max": 1e6 * max(r["masks"]), "accepted": r["accepted"]})
    print(f"\n{args.target}'s tokenizer ({lm.vocab_size} ids); {len(cases)} JSON schemas, "
          f"{sum(len(ids) for _, ids in cases)} tokens of reference answers")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}\n")
    print_table(rows, COLUMNS)
    checks = {f"{r['engine']} accepts every reference answer": r["accepted"] for r in rows}
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "cpu": cpu, "rows": rows,
                          "tokens": sum(len(ids) for _, ids in cases), "checks": checks})
    return report_checks(checks)


if __name__ == "__main__":
    sys.exit(main())
