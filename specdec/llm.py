"""The offline API, shaped like vLLM's: ``LLM(model, speculative_config=...).generate(prompts, params)``."""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.adaptive import AdaptiveK, calibrate
from specdec.config import (DEFAULT_TARGET, FEATURE_METHODS, SpeculativeConfig, check_quantization, check_vocab_compatible,
                            legacy_speculative_config)
from specdec.decoding import Lookahead, decode
from specdec.engine.kv_cache import DEFAULT_BLOCK_SIZE, DEFAULT_ENABLE_PREFIX_CACHING
from specdec.engine.network import DEFAULT_BATCH_INVARIANT, DEFAULT_QUANTIZATION
from specdec.engine.runner import ModelRunner
from specdec.engine.workers import DraftWorker, TargetWorker
from specdec.errors import ConfigError, InvalidRequestError
from specdec.engine.models import LoadedModel, load_model, model_max_len
from specdec.ngram import HybridDraftWorker, NgramStore, NgramWorker, lookup_indexes
from specdec.proposal import TokenLogprob
from specdec.sampling import SamplingParams, SpecDecodeStats
from specdec.sequence import SequenceState
from specdec.structured import GrammarCompiler
from specdec.seeding import DEFAULT_SEEDED_SAMPLING, check_seeded_sampling, output_seed



def eagle3_workers(cfg: SpeculativeConfig, target: LoadedModel, target_worker: TargetWorker, max_model_len: int,
                   device: str):
    """An EAGLE-3 head's draft worker and the target worker that feeds it features, joined by one relay."""
    from specdec.engine.eagle3_files import load_head, quantize_head
    from specdec.engine.eagle3_worker import Eagle3Worker, HeadStore
    from specdec.features import FeatureRelay, RelayedDraft, RelayedTarget
    from specdec.model_files import resolve_model_path

    text = target.model.config.get_text_config()
    embedding = target.model.get_input_embeddings().weight
    head, layers = load_head(resolve_model_path(cfg.model, cfg.revision)[0], target_hidden_size=text.hidden_size,
                             target_vocab_size=embedding.shape[0], target_num_layers=text.num_hidden_layers,
                             target_embedding=embedding.detach().float(), device=device)
    quantize_head(head, cfg.quantization, cfg.model)
    relay = FeatureRelay(layers)
    worker = Eagle3Worker(HeadStore(head, max_model_len), cfg.draft_sample_method,
                          eos_token_ids=frozenset(target.eos_token_ids), tree=cfg.tree_shape())
    if cfg.uses_suffix:  # enable_suffix_decoding: a suffix match proposes, else the head
        worker = HybridDraftWorker(worker, lookup_indexes(cfg), cfg.draft_model_num_speculative_tokens,
                                   cfg.suffix_decoding_merge_score)
    return RelayedDraft(worker, relay), RelayedTarget(target_worker, relay)


@dataclass
class Logprob:
    """vLLM's ``Logprob``: the target's raw log-probability of a token, its rank (1 = most likely; None
    when a chosen token is not among the top ones asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _logprob_dicts(entries: list[TokenLogprob | None], tokenizer: Any) -> list[dict[int, Logprob] | None]:
    """Per position ``{token_id: Logprob}``: the chosen token and the position's top ones (vLLM's shape)."""
    out: list[dict[int, Logprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranks = {t: r for r, (t, _) in enumerate(e.top, start=1)}
        position = {e.token_id: Logprob(e.logprob, ranks.get(e.token_id), tokenizer.decode([e.token_id]))}
        for rank, (t, v) in enumerate(e.top, start=1):
            position.setdefault(t, Logprob(v, rank, tokenizer.decode([t])))
        out.append(position)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    spec_decode_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    logprobs: list[dict[int, Logprob]] | None = None  # SamplingParams(logprobs=N): one dict per token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # SamplingParams(prompt_logprobs=N)

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Speculation statistics of the whole request (all ``n`` outputs)."""
        total = SpecDecodeStats()
        for out in self.outputs:
            total.merge(out.spec_decode_stats)
        return total


class LLM:
    """Generate with a target model, speculatively when ``speculative_config`` names a draft.

    >>> llm = LLM(model="smollm2-135m", speculative_config={"method": "draft_model",
    ...     "model": "path/to/draft", "num_speculative_tokens": 4})
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        *,
        seed: int | None = 0,
        max_model_len: int | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        revision: str | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        draft_dtype: str | None = None,
        kernels: str | None = None,
        lean_forward: bool | None = None,
        kv_cache_memory: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = DEFAULT_ENABLE_PREFIX_CACHING,
        batch_invariant: bool | None = DEFAULT_BATCH_INVARIANT,
        seeded_sampling: str = DEFAULT_SEEDED_SAMPLING,
        quantization: str = DEFAULT_QUANTIZATION,
        tree_tile_rows: int = 0,
    ):
        """``device``: "cpu" or "cuda[:N]"; ``dtype="auto"``: bfloat16 on CUDA; on CPU the faster of float32 and
        bfloat16 on this machine, measured once and cached (``specdec.engine.dtype_choice``; the environment
        variable ``SPECDEC_DTYPE_AUTO=float32|bfloat16`` pins it); an explicit dtype is used as given. ``kernels``:
        "auto" (Triton on CUDA, torch on CPU), "triton" or "torch" (default: $SPECDEC_KERNELS, else auto).
        ``lean_forward``: run both models through specdec's lean forward where their architecture allows
        (default: yes, ``specdec.engine.network.DEFAULT_LEAN_FORWARD``); False: transformers' forward.
        ``kv_cache_memory`` (bytes of each model's KV block pool; default: 2 GiB on CPU, 90% of free memory on
        CUDA), ``block_size`` and ``enable_prefix_caching``: vLLM's settings of the same names.
        ``batch_invariant``: forward passes whose logits do not depend on the shape of the pass (docs/exactness.md,
        "Exact by construction"; default None: on for a CPU target, off on CUDA).
        ``seeded_sampling``: the rule of requests with a seed and temperature > 0: "coupled" (default; the text
        depends on the seed, not on the draft, k or speculation: ``specdec.seeding``) or "rejection"
        (Leviathan/Chen rejection sampling). Requests without a seed always use rejection sampling.
        ``quantization``: the target's decoder products, "auto" (default: "none" for a target), "none", "int8"
        (W8A8) or "fp8" (CUDA); the
        draft's is ``speculative_config["quantization"]`` (default "int8"): see ``specdec.engine.quant``.
        ``tree_tile_rows``: token trees: the rows a verify pass costs by; a pass's trees are cut to fill no more
        such tiles than chains would (0: by device, 16 on a CPU; -1: never cut; ``specdec.trees.fit_trees``)."""
        try:  # before minutes of model loading
            check_seeded_sampling(seeded_sampling)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_quantization(quantization)
        kv = {"kv_cache_memory": kv_cache_memory, "block_size": block_size, "enable_prefix_caching": enable_prefix_caching}
        speculative_config = legacy_speculative_config(speculative_config, speculative_model, num_speculative_tokens)
        self.speculative_config = SpeculativeConfig.from_any(speculative_config)
        self.target = load_model(model or DEFAULT_TARGET, dtype=dtype, device=device, revision=revision)
        limit = model_max_len(self.target)
        if max_model_len is not None and max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        self.max_model_len = min(max_model_len or limit, limit)
        self._rng = random.Random(seed)
        self.draft: LoadedModel | None = None
        self._draft_worker: DraftWorker | None = None
        # batch invariance is the target's: the draft's numerics never change what is emitted
        self._target_worker = TargetWorker(ModelRunner(self.target, self.max_model_len, role="target",
                                                       lean_forward=lean_forward, batch_invariant=batch_invariant,
                                                       quantization=quantization, **kv),
                                           kernels=kernels, seeded_sampling=seeded_sampling,
                                           tree_tile_rows=tree_tile_rows)
        cfg = self.speculative_config
        if cfg is not None and cfg.model_free:  # no draft model: the histories draft (n-gram / suffix)
            if cfg.max_model_len is not None:
                self.max_model_len = min(self.max_model_len, cfg.max_model_len)
                self._target_worker.runner.max_model_len = self.max_model_len
            self._draft_worker = NgramWorker(NgramStore(lookup_indexes(cfg)))
        elif cfg is not None and cfg.method in FEATURE_METHODS:  # a head over the target's features
            self._draft_worker, self._target_worker = eagle3_workers(cfg, self.target, self._target_worker,
                                                                     self.max_model_len, device)
        elif cfg is not None:
            self.draft = load_model(cfg.model, dtype=draft_dtype or dtype, device=device, revision=cfg.revision)
            heterogeneous = check_vocab_compatible(
                self.target.tokenizer_fingerprint, self.draft.tokenizer_fingerprint, self.target.name, cfg.model, cfg
            )
            if cfg.max_model_len is not None:
                self.max_model_len = min(self.max_model_len, cfg.max_model_len)
            if not heterogeneous:  # with TLI the draft counts its own tokens against its own limit
                self.max_model_len = min(self.max_model_len, model_max_len(self.draft))
            self._target_worker.runner.max_model_len = self.max_model_len
            tli = None
            if heterogeneous:
                from specdec.tli.adapter import TLIAdapter

                tli = TLIAdapter(self.draft.tokenizer, self.target.tokenizer, self.target.vocab_size,
                                 proposals=cfg.tli_proposals, kernels=kernels)
            # With TLI the draft keeps its own logits; the adapter maps proposals to target ids.
            draft_runner = ModelRunner(self.draft, model_max_len(self.draft) if tli else self.max_model_len, role="draft",
                                       logits_vocab_size=None if tli else self.target.vocab_size,
                                       lean_forward=lean_forward, quantization=cfg.quantization, **kv)
            self._draft_worker = DraftWorker(draft_runner, cfg.draft_sample_method, tli=tli, tree=cfg.tree_shape())
            if cfg.uses_lookup:  # hybrid: a lookup (n-gram / suffix) match proposes, else the draft model
                self._draft_worker = HybridDraftWorker(self._draft_worker, lookup_indexes(cfg),
                                                       cfg.draft_model_num_speculative_tokens,
                                                       cfg.suffix_decoding_merge_score)
        # overlapped drafting: the draft's lookahead runs on this thread while the target verifies
        self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="lookahead") if cfg is not None and cfg.overlap \
            else None
        self._round_costs = None  # adaptive k: a round's measured costs by k
        if cfg is not None and cfg.adaptive_k:
            text = self.target.tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
            self._round_costs = calibrate(self._draft_worker, self._target_worker, list(text) or [0],
                                          cfg.num_speculative_tokens)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler over the target's tokenizer and logits (built on first use)."""
        return GrammarCompiler(self.target.tokenizer, self.target.vocab_size, self.target.eos_token_ids)

    @property
    def token_id_limit(self) -> int:
        """Valid token ids are below this: the tokenizer's size, and both models' embeddings."""
        limits = [self.target.vocab_size, len(self.target.tokenizer)]
        if self.draft is not None and getattr(self._draft_worker, "tli", None) is None:
            limits.append(self.draft.vocab_size)
        return min(limits)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def get_tokenizer(self) -> Any:
        return self.target.tokenizer

    # -- requests --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
                return prompt.get("prompt"), ids
            prompt = prompt.get("prompt", "")
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}", param="prompt")
        return prompt, list(self.target.tokenizer(prompt).input_ids)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, which leaves no room "
                "to generate", param="prompt"
            )
        vocab = self.token_id_limit
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")

    def new_sequence(self, prompt_token_ids: list[int], params: SamplingParams, index: int = 0) -> SequenceState:
        self._check_prompt(prompt_token_ids)
        if params.seed is None:
            # reproducible runs, yet an unseeded request: rejection sampling, as in the services
            params = params.clone(seed=self._rng.getrandbits(63), engine_seed=True)
        elif index:
            params = params.clone(seed=output_seed(params.seed, index))  # n > 1: distinct, reproducible samples
        return SequenceState(
            prompt_token_ids=prompt_token_ids,
            params=params,
            tokenizer=self.target.tokenizer,
            eos_token_ids=self.target.eos_token_ids,
            max_model_len=self.max_model_len,
            constraint=self.grammars.constraint(params.structured_outputs),
        )

    def speculating(self, num_unfinished: int) -> bool:
        """vLLM's ``disable_by_batch_size``: no speculation while the requests not yet finished number at least
        the threshold (vLLM: running queue size >= disable_by_batch_size); back on as they finish."""
        cfg = self.speculative_config
        if cfg is None:
            return False
        return cfg.disable_by_batch_size is None or num_unfinished < cfg.disable_by_batch_size

    def stream(self, seq: SequenceState, num_unfinished: int = 1) -> Iterator[str]:
        """Generate one sequence, yielding text deltas as rounds complete. ``num_unfinished``: the sequences
        enqueued and not finished, this one included (``generate`` runs them one after another), for
        ``disable_by_batch_size``."""
        if not self.speculating(num_unfinished):
            return decode(None, self._target_worker, seq, 0)  # the target alone: no drafts, nothing to release
        k = self.num_speculative_tokens
        return decode(self._draft_worker, self._target_worker, seq,
                      AdaptiveK(self._round_costs, k) if self._round_costs is not None else k,
                      Lookahead(self._ahead_pool.submit) if self._ahead_pool is not None else None)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError(
                f"got {len(prompts)} prompts but {len(params_list)} sampling params", param="sampling_params"
            )
        parsed = [self._prompt_ids(p) for p in prompts]
        for _, ids in parsed:
            self._check_prompt(ids)
        results: list[RequestOutput] = []
        iterator: Any = zip(parsed, params_list)
        if use_tqdm:
            from tqdm.auto import tqdm

            iterator = tqdm(iterator, total=len(prompts), desc="generate")
        unfinished = sum(p.n for p in params_list)  # vLLM enqueues every sequence of the call at once
        for i, ((text, ids), params) in enumerate(iterator):
            outputs = []
            prompt_logprobs = None
            tok = self.target.tokenizer
            for j in range(params.n):
                seq = self.new_sequence(ids, params, index=j)
                for _ in self.stream(seq, unfinished):
                    pass
                unfinished -= 1
                lps = None if seq.logprobs is None else _logprob_dicts(seq.logprobs, tok)
                outputs.append(CompletionOutput(j, seq.text, list(seq.output_token_ids), seq.finish_reason,
                                                seq.stop_reason, seq.stats, lps))
                if seq.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = _logprob_dicts(seq.prompt_logprobs, tok)
            results.append(RequestOutput(str(i), text, ids, outputs, prompt_logprobs=prompt_logprobs))
        return results
