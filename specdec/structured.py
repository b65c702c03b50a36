"""Structured outputs: a request's grammar (JSON schema, JSON, regex, choice, EBNF) as allowed-token masks.

The grammar engine is xgrammar (vLLM's default backend): per-token masks in ~5 us median on a 2-vCPU
EPYC (llguidance ~43 us on the same JSON schemas, ``benchmarks/bench_grammar_engines.py``), rollback, and
jump-forward strings. One ``GrammarCompiler`` per tokenizer (its compile cache is shared by requests);
one ``Constraint`` per sequence, owned by the sequence's loop:

- the matcher advances only over committed tokens (``accept``);
- each round, ``constrain`` walks the round's drafts on the matcher, writes the allowed-token row of
  every verified position (the drafts' and the next token's), keeps the drafts up to and including
  the first one the grammar forbids (the target rejects it for certain: its constrained probability is
  0, so rejection sampling's residual, not a truncation, decides that position — exact for sampled
  requests), and rolls the matcher back;
- where the grammar forces a string (xgrammar's jump-forward), its tokens are the round's drafts
  unless the drafter already proposed them: forced text is verified in the same pass, without drafting.

The target applies the rows before its penalties / temperature / top-k / top-p
(``specdec.token_mask``), so every verified position samples from the constrained distribution
target-only decoding samples from: lossless by construction, whatever the drafts were.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.lark_grammar import LarkConversionError, is_likely_lark, lark_to_ebnf
from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS, Proposal

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, dict or string),
    ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF/GBNF with a ``root`` rule, or Lark with a
    ``start`` rule: ``specdec.lark_grammar``) or
    ``json_object`` (any JSON object). ``disable_any_whitespace``: JSON without free whitespace."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    param: str = field(default="structured_outputs", compare=False)  # the request field named in errors

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.param} needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}", param=self.param)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{self.param}.choice must be a non-empty list of non-empty strings",
                                      param=f"{self.param}.choice")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise InvalidRequestError(f"{self.param}.{name} must be a non-empty string", param=f"{self.param}.{name}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(f"{self.param}.json must be a JSON schema (an object)", param=f"{self.param}.json")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


# The longest run of whitespace a JSON schema's output may hold between tokens (xgrammar's max_whitespace_cnt):
# room for any pretty-printing, while a model stuck emitting whitespace (a known failure of free JSON
# whitespace) cannot run to max_tokens. vLLM leaves it unbounded.
MAX_JSON_WHITESPACE = 16

_ENGINE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+: (Check failed: \(.*?\) is false: )?")


def _engine_message(exc: BaseException) -> str:
    return _ENGINE_PREFIX.sub("", str(exc).strip()).strip()


class GrammarCompiler:
    """Compiles requests' structured outputs for one tokenizer and vocabulary (the target's: masks are
    over its logits). Thread-safe; compiled grammars are cached by xgrammar (same spec, compiled once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _engine(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
                    raise InvalidRequestError(f"structured outputs need the xgrammar package ({exc}); pip install "
                                              "xgrammar") from None
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        compiler = self._engine()
        kind, param = spec.kind, f"{spec.param}.{spec.kind}"
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "json_object":  # OpenAI's JSON mode: an object (not any JSON value), any properties
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    any_whitespace=not spec.disable_any_whitespace,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in spec.choice))
            if is_likely_lark(spec.grammar):  # as vLLM's xgrammar backend: Lark converted to EBNF
                try:
                    return compiler.compile_grammar(lark_to_ebnf(spec.grammar))
                except LarkConversionError as exc:
                    raise InvalidRequestError(f"the Lark grammar in {param} cannot be converted: {exc}",
                                              param=param) from None
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar (EBNF with a 'root' "
                    "rule, or Lark with a 'start' rule)", "choice": "choice list", "json_object": "JSON grammar"}[kind]
            raise InvalidRequestError(f"the {what} in {param} cannot be compiled: {_engine_message(exc)}",
                                      param=param) from None

    def constraint(self, spec: StructuredOutputsParams | None) -> "Constraint | None":
        if spec is None:
            return None
        return Constraint(self.compile(spec), self.vocab_size,
                          lambda text: list(self.tokenizer.encode(text, add_special_tokens=False)))


@dataclass
class ConstraintStats:
    """What the grammar did for one sequence: drafts it forbade, tokens it forced (jump-forward)."""

    num_forced_tokens: int = 0  # jump-forward tokens proposed (verified like any draft)
    num_invalid_drafts: int = 0  # drafts the grammar forbade (sent on, rejected for certain)


class Constraint:
    """One sequence's grammar state (see the module's docstring)."""

    def __init__(self, compiled: Any, vocab_size: int, encode: Callable[[str], list[int]]):
        import xgrammar

        self._xgr = xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.encode = encode
        self.stats = ConstraintStats()
        self._rows = xgrammar.allocate_token_bitmask(MAX_NUM_SPECULATIVE_TOKENS + 1, vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance over a committed token (False: the grammar does not allow it, e.g. after it ended)."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def next_mask(self):
        """The allowed-token row of the next position ([1, words] int32)."""
        return self.constrain(Proposal([]), 0, 0).token_bitmask

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens of the string the grammar forces next (xgrammar's jump-forward), at most ``limit``."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        return self.encode(text)[:limit] if text else []

    def constrain(self, proposal: Proposal, limit: int, forced_limit: int) -> Proposal:
        """The round's proposal with one allowed-token row per verified position (``token_bitmask``,
        [drafts + 1, words]): drafts up to ``limit``, cut after the first one the grammar forbids;
        the forced string's tokens (up to ``forced_limit``; 0: none) when the drafts do not start with them."""
        limit = max(0, min(limit, MAX_NUM_SPECULATIVE_TOKENS))
        drafts = proposal.draft_token_ids[:limit]
        if forced_limit > 0:
            forced = self.forced_tokens(min(limit, forced_limit))
            if forced and drafts[:len(forced)] != forced:
                proposal, drafts = Proposal(forced), forced  # forced text is not sampled: one-hot q
                self.stats.num_forced_tokens += len(forced)
        rows, matcher = self._rows, self.matcher
        consumed, n, reached = 0, len(drafts), True  # reached: the position after the kept drafts is valid
        for j, token in enumerate(drafts):
            if matcher.is_terminated():  # the grammar ended at its stop token: the sequence ends there
                n, reached = j, False
                break
            matcher.fill_next_token_bitmask(rows, j)
            if not (int(rows[j, token // 32]) >> (token % 32)) & 1 or not matcher.accept_token(token):
                n, reached = j + 1, False  # sent on: the target's constrained p is 0 there, so it is rejected
                self.stats.num_invalid_drafts += 1
                break
            consumed += 1
        if reached and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(rows, n)
        else:  # never sampled from: after a forbidden draft or the grammar's end (or ignore_eos: free text)
            rows[n].fill_(-1)
        if consumed:
            matcher.rollback(consumed)
        out = proposal.truncated(n)
        out.token_bitmask = rows[:n + 1].clone()
        return out
