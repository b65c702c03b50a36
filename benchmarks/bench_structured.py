"""Structured outputs with speculation on: schema-constrained JSON answers, served, against the target alone
under the same constraints; and the official ``openai`` client's ``parse`` (pydantic models, response formats
and tool calls) against the suffix/draft-model pair, every parsed object validated.

Side by side in one run (each setup a ``specdec serve`` stack in a process of its own; ``--in-process``: all in
this one), greedy:

  * the target alone (``structured_outputs`` applied at every position, no drafting);
  * suffix decoding before the draft model (``specdec.config.draft_model_pair_config``, the shipped default before
    the EAGLE-3 head): the grammar's forced text proposed without drafting (jump-forward), drafts checked against
    the grammar.

(a) speed: ``--tasks`` extraction requests (a source text and a JSON schema each, through the target's chat
    template, gRPC ``GenerateRequest.structured_outputs``), each setup back to back per request. Reported:
    tokens/s, speed-up, tokens per verify pass, mean draft, every output identical to the target alone's, and
    the share of forced tokens (positions where the grammar allows exactly one token, replayed on the outputs).
(b) validity: ``--parse-requests`` (200) sampled requests (temperature 0.8, seeds) through
    ``client.beta.chat.completions.parse`` against the default stack: half a pydantic ``response_format``, half
    a strict function tool (``openai.pydantic_function_tool``, tool_choice naming it); each parsed object
    must validate (a reply cut by ``--parse-max-tokens`` counts as a failure). Every string of the models
    has a maximum length, as an agent's schema would: a small model sampling free text may not stop.

Goal (issue 31): (a) >= 1.5x the target alone on this CPU; (b) 100% valid.

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --smoke   # tiny random-weight models, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Literal

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafting import InProcessStack, chat_formatter  # noqa: E402
from bench_serving import ServedStack  # noqa: E402
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, report_checks,  # noqa: E402
                    smoke_environment, smoke_models, write_json)

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET, draft_model_pair_config  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

GOAL = 1.5
COLUMNS = ["setup", "tokens/s", "speedup", "tokens/pass", "mean draft", "acceptance", "forced share", "identical",
           "finished"]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


S, I = {"type": "string", "maxLength": 60}, {"type": "integer"}
TASKS = [
    ("Ada Lovelace, 36, is a mathematician who lives in London.", _obj({"name": S, "age": I, "city": S, "job": S})),
    ("Order #4411: 2 blue mugs at 7.50 each and 1 teapot at 24.00, shipped to Oslo.",
     _obj({"order_id": I, "items": {"type": "array", "items": _obj({"name": S, "quantity": I, "unit_price":
                                                                    {"type": "number"}})}, "city": S})),
    ("The team meeting on 2026-03-14 at 10:30 in room B2 covers the budget and hiring.",
     _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "time": S, "room": S,
           "topics": {"type": "array", "items": S}})),
    ("Review: 'The headphones sound great but the battery dies after two hours.' Rating four of five.",
     _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "sentiment": {"enum": ["positive", "negative",
                                                                                          "mixed"]}, "pros": S,
           "cons": S})),
    ("Call the weather tool for Paris, France, for the next three days, in Celsius.",
     _obj({"name": {"enum": ["get_weather"]}, "arguments": _obj({"city": S, "country": S, "days": I,
                                                                 "unit": {"enum": ["celsius", "fahrenheit"]}})})),
    ("The book 'Dune' by Frank Herbert was published in 1965 by Chilton Books.",
     _obj({"title": S, "author": S, "year": I, "publisher": S})),
    ("Server web-3 in eu-west: CPU 93%, memory 71%, status degraded since 04:10.",
     _obj({"host": S, "region": S, "cpu_percent": I, "memory_percent": I, "status": {"enum": ["ok", "degraded",
                                                                                           "down"]}, "since": S})),
    ("Flight LH 1234 from Frankfurt to Lisbon departs at 07:45 from gate A12; boarding at 07:05.",
     _obj({"flight": S, "from": S, "to": S, "departure": S, "gate": S, "boarding": S})),
    ("Recipe: pancakes need 200 g flour, 2 eggs, 300 ml milk and a pinch of salt.",
     _obj({"dish": S, "ingredients": {"type": "array", "items": _obj({"item": S, "amount": S})}})),
    ("Bug: clicking Save on the settings page in Firefox 128 shows a blank screen; severity high.",
     _obj({"title": S, "component": S, "browser": S, "severity": {"enum": ["low", "medium", "high"]}})),
]


def task_message(text: str, schema: dict) -> str:
    return f"Extract the information as JSON with the keys {', '.join(schema['properties'])}.\n\n{text}"


def setups(args) -> dict[str, dict | None]:
    return {"target alone": None, "suffix + draft model": {**draft_model_pair_config(), "model": args.draft}}


def generate(stub, prompt: str, schema: dict, max_tokens: int) -> dict:
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, structured_outputs=pb.StructuredOutputs(
        json=json.dumps(schema)), sampling_params=common_pb2.SamplingParams(temperature=0))
    ids: list[int] = []
    start = time.perf_counter()
    last = None
    for resp in stub.Generate(req, timeout=900):
        ids.extend(resp.token_ids)
        last = resp
    return {"seconds": time.perf_counter() - start, "token_ids": ids, "finish": last.finish_reason,
            "drafts": last.stats.num_drafts, "drafted": last.stats.num_draft_tokens,
            "accepted": last.stats.num_accepted_tokens, "passes": last.stats.num_target_passes}


def grammar_costs(target: str, runs: list[dict], schemas: list[dict], k: int = 15) -> dict:
    """Replayed on the outputs: the share of positions where the schema's grammar allows exactly one token
    (forced), and what the gateway's grammar work costs a round: ``constrain`` of the next ``k`` tokens as
    drafts (k + 1 mask rows, the check, the rollback) and the rows' bytes on the wire."""
    from specdec.engine.models import load_model
    from specdec.proposal import Proposal
    from specdec.structured import GrammarCompiler, StructuredOutputsParams
    from specdec.token_mask import allowed_rows

    lm = load_model(target, dtype="float32")
    grammars = GrammarCompiler(lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    forced = total = 0
    times: list[float] = []
    for run, schema in zip(runs, schemas):
        c = grammars.constraint(StructuredOutputsParams(json=schema))
        ids = run["token_ids"]
        for i, t in enumerate(ids):
            if c.terminated:
                break
            start = time.perf_counter()
            c.constrain(Proposal(ids[i:i + k]), k, 0)
            times.append(time.perf_counter() - start)
            forced += int(allowed_rows(c.next_mask(), lm.vocab_size).sum()) == 1
            total += 1
            c.accept(t)
    times.sort()
    words = (lm.vocab_size + 31) // 32
    return {"forced_share": forced / total if total else 0.0, "positions": total,
            "constrain_ms_median": 1000 * times[len(times) // 2] if times else None,
            "constrain_ms_p90": 1000 * times[int(0.9 * len(times))] if times else None,
            "mask_bytes_per_round": 4 * words * (k + 1)}


def scrape(http_port: int) -> dict:
    """The gateway's structured-output and drafting counters (summed over labels) from its /metrics."""
    import urllib.request

    names = ("specdec_structured_output_forced_tokens_total", "specdec_structured_output_invalid_draft_tokens_total",
             "specdec_spec_decode_num_draft_tokens_total")
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out and 'service="gateway"' in line:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def parse_run(base_url: str, model: str, n: int, max_tokens: int) -> dict:
    """``n`` sampled ``parse`` calls (pydantic response formats and strict tools); how many validated."""
    import openai
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=130)
        city: str = Field(max_length=40)

    class Event(BaseModel):
        title: str = Field(max_length=60)
        date: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
        attendees: list[Annotated[str, Field(max_length=30)]] = Field(max_length=6)

    class GetWeather(BaseModel):
        city: str = Field(max_length=40)
        days: int = Field(ge=1, le=14)
        unit: Literal["celsius", "fahrenheit"]

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    asks = [("Ada is 36 and lives in London. Who is she?", Person),
            ("Plan a project kickoff on 2026-05-04 with Ann, Bo and Cy.", Event),
            ("What's the weather in Oslo this week, in celsius?", GetWeather)]
    valid, failures = 0, []
    started = time.perf_counter()
    for i in range(n):
        text, cls = asks[i % len(asks)]
        messages = [{"role": "user", "content": text}]
        kw = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0.8, seed=i)
        try:
            if i % 2:  # a strict function tool the call must use
                out = client.beta.chat.completions.parse(tools=[openai.pydantic_function_tool(cls)], tool_choice={
                    "type": "function", "function": {"name": cls.__name__}}, **kw)
                parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
            else:
                out = client.beta.chat.completions.parse(response_format=cls, **kw)
                parsed = out.choices[0].message.parsed
            ok = isinstance(parsed, cls)
        except Exception as exc:  # noqa: BLE001 - a failure to parse or validate is what is counted
            ok = False
            failures.append(f"{i}: {type(exc).__name__}: {str(exc)[:200]}")
        valid += ok
    return {"requests": n, "valid": valid, "seconds": time.perf_counter() - started, "failures": failures[:10]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="the shipped default's draft model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=len(TASKS), help="extraction requests of (a), at most %(default)s")
    ap.add_argument("--repeats", type=int, default=1, help="times (a) is run (the suffix tree learns on repeats)")
    ap.add_argument("--parse-requests", type=int, default=200, help="requests of (b)")
    ap.add_argument("--max-tokens", type=int, default=160, help="per request of (a)")
    ap.add_argument("--parse-max-tokens", type=int, default=256, help="per request of (b)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each served stack (0: all cores)")
    ap.add_argument("--in-process", action="store_true", help="all stacks in this process (default with --smoke)")
    add_common_args(ap)
    add_strict_arg(ap)
    args = ap.parse_args()
    out_path = json_path(args, "structured")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.tasks, args.parse_requests, args.max_tokens, args.threads, args.in_process = 2, 2, 24, 1, True
        args.parse_max_tokens = 24
    fmt = chat_formatter(args.target, True)
    tasks = TASKS[:args.tasks] * args.repeats
    prompts = [fmt(task_message(text, schema)) for text, schema in tasks]
    specs = setups(args)
    labels = list(specs)
    runs: dict[tuple[str, int], dict] = {}
    started = time.perf_counter()
    with contextlib.ExitStack() as es:
        stubs, ports = {}, {}
        for label, spec in specs.items():
            cfg = dict(model=args.target, host="127.0.0.1", grpc_port=0, port=0, dtype=args.dtype,
                       draft_dtype=args.dtype, num_threads=args.threads,
                       speculative_config=None if spec is None else json.dumps(spec))
            stack = es.enter_context(InProcessStack(cfg) if args.in_process else ServedStack(cfg))
            ports[label] = stack.ports()
        for label, (grpc_port, _) in ports.items():
            channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
            stubs[label] = generation_service_pb2_grpc.GenerationServiceStub(channel)
            generate(stubs[label], fmt("Say hi as JSON."), {"type": "object"}, 4)  # warm-up
        print(f"{len(stubs)} stacks up in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        measure_start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            order = labels if i % 2 == 0 else labels[::-1]
            for label in order:
                runs[(label, i)] = generate(stubs[label], prompt, tasks[i][1], args.max_tokens)
        measured_s = time.perf_counter() - measure_start
        served = scrape(ports[labels[1]][1])  # the default stack's grammar counters after (a)
        parse = parse_run(f"http://127.0.0.1:{ports[labels[1]][1]}", args.target, args.parse_requests,
                          args.parse_max_tokens)
    cpu["load_average_end"] = list(os.getloadavg())
    rows = []
    base = None
    costs = grammar_costs(args.target, [runs[(labels[0], i)] for i in range(len(prompts))], [t[1] for t in tasks])
    share = costs["forced_share"]
    for label in labels:
        res = [runs[(label, i)] for i in range(len(prompts))]
        tokens = sum(len(r["token_ids"]) for r in res)
        tps = tokens / sum(r["seconds"] for r in res)
        base = base or tps
        drafts, drafted, passes = (sum(r[k] for r in res) for k in ("drafts", "drafted", "passes"))
        rows.append({"setup": label, "tokens/s": tps, "speedup": tps / base, "tokens/pass": tokens / passes,
                     "mean draft": drafted / drafts if drafts else None,
                     "acceptance": sum(r["accepted"] for r in res) / drafted if drafted else None,
                     "forced share": share,
                     "identical": all(runs[(label, i)]["token_ids"] == runs[(labels[0], i)]["token_ids"]
                                      for i in range(len(prompts))),
                     "finished": sum(r["finish"] == pb.FINISH_REASON_STOP for r in res) / len(res)})
    print(f"\n{args.target}, greedy, {args.dtype}, served (gRPC, one stream), JSON schema per request, up to "
          f"{args.max_tokens} tokens; {len(prompts)} requests; speedup = vs the target alone (same constraints)")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}; load "
          f"average {cpu['load_average_start'][0]:.1f} -> {cpu['load_average_end'][0]:.1f}; measured {measured_s:.0f} s\n")
    print_table(rows, COLUMNS)
    print(f"\ngrammar work per round (k=15 drafts, replayed): constrain {costs['constrain_ms_median']:.2f} ms median, "
          f"{costs['constrain_ms_p90']:.2f} ms p90; {costs['mask_bytes_per_round'] / 1024:.0f} KiB of mask rows")
    drafted = served["specdec_spec_decode_num_draft_tokens_total"]
    print(f"the default's drafts in (a): {drafted:.0f} tokens proposed, of which "
          f"{served['specdec_structured_output_forced_tokens_total']:.0f} forced text (jump-forward) and "
          f"{served['specdec_structured_output_invalid_draft_tokens_total']:.0f} forbidden by the grammar")
    print(f"parse (openai client, pydantic formats and strict tools, sampled): {parse['valid']}/{parse['requests']} "
          f"valid in {parse['seconds']:.0f} s")
    goals = {f"suffix/draft-model pair >= {GOAL}x the target alone ({rows[1]['speedup']:.2f}x)": rows[1]["speedup"] >= GOAL}
    checks = {"every output identical to the target alone's": all(r["identical"] for r in rows),
              f"every parsed object valid ({parse['valid']}/{parse['requests']})": parse["valid"] == parse["requests"]}
    if args.smoke:  # random weights need not close their JSON: only that the script runs and agrees
        checks = {k: v for k, v in checks.items() if k.startswith("every output")}
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": args.draft, "dtype": args.dtype,
                          "max_tokens": args.max_tokens, "cpu": cpu, "setups": specs, "rows": rows, "parse": parse, "grammar_costs": costs, "served_counters": served,
                          "goals": goals, "checks": checks, "measured_seconds": measured_s,
                          "tasks": [{"text": t, "schema": s} for t, s in tasks],
                          "measurements": [{"setup": label, "request": i, "tokens": len(r["token_ids"]),
                                            **{k: v for k, v in r.items() if k != "token_ids"}}
                                           for (label, i), r in runs.items()]})
    if tmp is not None:
        tmp.cleanup()
    return report_checks(checks, goals, args.strict)


if __name__ == "__main__":
    sys.exit(main())
