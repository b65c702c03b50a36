"""What a draft or target service runs, minus gRPC: model, workers, batching, cache limits.

The servicers translate protobuf to the calls here and back; nothing here imports grpc.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from specdec.config import DEFAULT_TARGET, check_quantization, parse_byte_size
from specdec.drafting_state import AnsweredHistory
from specdec.errors import BackendUnavailableError, ConfigError, InvalidRequestError, SequenceNotFoundError
from specdec.engine.memory import resident_bytes
from specdec.engine.dtype_choice import dtype_name
from specdec.engine.models import LoadedModel, load_model, model_max_len
from specdec.history import TokenHistory, common_prefix
from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS, Proposal, VerifyResult, check_num_speculative_tokens
from specdec.ngram import HybridDraftWorker, NgramStore, NgramWorker
from specdec.suffix import SuffixCache
from specdec.engine.kv_cache import (DEFAULT_BLOCK_SIZE, DEFAULT_ENABLE_PREFIX_CACHING,
                                     DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY)
from specdec.engine.scheduler import (DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                      DEFAULT_MAX_NUM_PARTIAL_PREFILLS, check_budget)
from specdec.engine.network import DEFAULT_BATCH_INVARIANT, DEFAULT_LEAN_FORWARD, DEFAULT_QUANTIZATION
from specdec.engine.runner import ModelRunner, set_num_threads
from specdec.sampling_params import SamplingParams
from specdec.seeding import DEFAULT_SEEDED_SAMPLING
from specdec.serving.batching import ComputeThread, ContinuousBatcher
from specdec.serving.metrics import ServiceMetrics, set_build_info
from specdec.calls import ProposeCall, VerifyCall
from specdec.engine.workers import DraftWorker, TargetWorker

logger = logging.getLogger(__name__)
NGRAM_MAX_MODEL_LEN = 1 << 20  # an n-gram draft has no context limit of its own
LIVE_WINDOW_S = 10.0  # a sequence served within this many seconds is live: a drain waits for it


@dataclass
class BackendConfig:
    """Settings both services share (each service's config carries these fields)."""

    model: str = field(default=DEFAULT_TARGET, metadata={"help": "model: built-in name, HF folder, .gguf or hub id"})
    revision: str | None = field(default=None, metadata={"help": "hub revision"})
    dtype: str = field(default="auto", metadata={
        "help": "float32 or bfloat16 (auto: bfloat16 on CUDA; on CPU the faster of float32 and bfloat16 here, measured "
                "once and cached in $SPECDEC_CACHE/dtype_auto.json; SPECDEC_DTYPE_AUTO=float32|bfloat16 pins it, "
                "SPECDEC_DTYPE_AUTO_CACHE=0 measures again)"})
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda or cuda:N"})
    kernels: str | None = field(default=None, metadata={
        "help": "verification kernels: auto (Triton on CUDA, torch on CPU), triton (on a CPU: Triton's interpreter, "
                "for testing) or torch (default: $SPECDEC_KERNELS, else auto)"})
    max_model_len: int | None = field(default=None, metadata={"help": "max tokens per sequence (default: the model's)"})
    max_sequences: int = field(default=256, metadata={"help": "cap on cached sequences (RESOURCE_EXHAUSTED past it)"})
    sequence_ttl_seconds: float = field(default=600.0, metadata={"help": "idle sequences are evicted after this"})
    max_batch_size: int = field(default=16, metadata={"help": "max sequences per batched forward pass"})
    batch_wait_ms: float = field(default=10.0, metadata={
        "help": "when idle, a batch waits up to this long for sequences that recent traffic says are mid round trip "
                "(a guess; 0: never guess, a batch runs what is queued); a lone stream never waits. Calls the gateway "
                "marks as one group (batch hints) are gathered whatever this is, for up to max(this, 50 ms)"})
    num_threads: int = field(default=0, metadata={"help": "CPU threads for this service's forward passes (0: all cores it may use)"})
    lean_forward: bool = field(default=DEFAULT_LEAN_FORWARD, metadata={
        "help": "run forward passes through specdec's lean forward where the model's architecture allows it (Llama "
                "family, Gemma-3; else transformers' forward, the reason logged); --no-lean-forward: transformers' "
                "forward always"})
    batch_invariant: bool | None = field(default=DEFAULT_BATCH_INVARIANT, metadata={
        "help": "batch-invariant forward passes: a position's logits are the same bits whatever else the pass holds "
                "(fixed-shape products, attention over fixed key chunks), so greedy verification picks exactly the "
                "target-alone token (a target's setting: a draft's numerics never change the output; default: on for "
                "CPU models, off on CUDA; --no-batch-invariant: the fastest kernel per shape)"})
    quantization: str = field(default=DEFAULT_QUANTIZATION, metadata={
        "help": "the decoder products' formulation: none (the --dtype's), int8 (W8A8: int8 weights per output channel, "
                "int8 activations per token, SmoothQuant-calibrated; CPU and CUDA) or fp8 (CUDA, compute capability "
                "8.9+); auto (default): int8 for a draft (its numerics change only the acceptance), none for a target"})
    # The KV block pool of the model (vLLM's paged KV cache: --kv-cache-memory-bytes, --block-size,
    # --enable-prefix-caching, --gpu-memory-utilization).
    kv_cache_memory: int | None = field(default=None, metadata={
        "parse": parse_byte_size, "metavar": "BYTES",
        "help": "bytes of the KV cache pool, e.g. 2GiB, 512MiB, 1e9 (vLLM's kv_cache_memory_bytes; default: "
                f"{DEFAULT_KV_CACHE_MEMORY // 2**30}GiB on CPU, on CUDA --gpu-memory-utilization of the device's memory "
                "less what is in use)"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per KV cache block"})
    enable_prefix_caching: bool = field(default=DEFAULT_ENABLE_PREFIX_CACHING, metadata={
        "help": "share the KV blocks of equal prefixes between sequences (--no-enable-prefix-caching: never)"})
    gpu_memory_utilization: float = field(default=DEFAULT_GPU_MEMORY_UTILIZATION, metadata={
        "help": "on CUDA without --kv-cache-memory: the share of the device memory still free once the model is "
                "loaded that its KV pool takes"})
    # Each pass's tokens (specdec.engine.scheduler; vLLM's settings of the same names): decode and verify rows
    # first, then prompts in chunks.
    max_num_batched_tokens: int = field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, metadata={
        "help": "tokens one forward pass feeds at most: decode and verify rows whole, prompts in chunks of what is left"})
    long_prefill_token_threshold: int = field(default=DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD, metadata={
        "help": "while other sequences decode, a prompt's chunk per pass is at most this many tokens, so their rounds "
                "never wait for a whole prompt (0: sized from what passes measured here, a chunk costing about 3 "
                "of the decoding sequences' round periods; alone, a prompt takes the whole budget)"})
    max_num_partial_prefills: int = field(default=DEFAULT_MAX_NUM_PARTIAL_PREFILLS, metadata={
        "help": "prompts prefilled in the same pass while other sequences decode (the oldest first)"})


def check_kv_settings(cfg: BackendConfig) -> None:
    """The KV pool's settings, checked before minutes of model loading (ConfigError naming the flag)."""
    if cfg.kv_cache_memory is not None and cfg.kv_cache_memory < 1:
        raise ConfigError(f"--kv-cache-memory must be a positive number of bytes, got {cfg.kv_cache_memory}")
    if cfg.block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {cfg.block_size}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    check_quantization(cfg.quantization)
    try:
        check_budget(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def cpu_threads(requested: int) -> int:
    """``requested``, or every core this process may run on when it is 0."""
    if requested < 0:
        raise ValueError(f"num_threads must be >= 0, got {requested}")
    return requested or len(os.sched_getaffinity(0))


class Backend:
    """A loaded model serving Propose (draft) or Verify (target) through a continuous batcher."""

    def __init__(self, role: str, config: BackendConfig, draft_sample_method: str = "greedy",
                 draft_top_n: int | None = None, target_tokenizer: str | None = None,
                 compute: ComputeThread | None = None, tli_proposals: str = "text",
                 lookup: Any = None, model_free: str | None = None, model_k: int | None = None,
                 seeded_sampling: str = DEFAULT_SEEDED_SAMPLING, eagle_target: str | None = None,
                 tree_shape: Any = None, tree_tile_rows: int = 0, merge_score: float = 0.0):
        if role not in ("draft", "target"):
            raise ValueError(role)
        self.role = role
        self.config = config
        self.draft_sample_method = draft_sample_method
        self.draft_top_n = draft_top_n
        self.target_tokenizer = target_tokenizer
        self.tli_proposals = tli_proposals
        self.seeded_sampling = seeded_sampling  # the target's rule for seeded sampled requests
        self.tree_tile_rows = tree_tile_rows  # the target's: the rows its passes cost by (TargetWorker)
        # lookup drafting (n-gram or suffix; ``lookup`` makes each sequence's index, see
        # SpeculativeConfig.lookup_indexes): alone (model_free names the method; no model is loaded) or
        # before the draft model (hybrid)
        self.lookup = lookup
        self.model_free = model_free
        self.model_k = model_k  # hybrid: the draft model's k (None: the call's)
        self.merge_score = merge_score  # hybrid trees: a lookup tree scoring below this is merged with the model's
        self.tree_shape = tree_shape  # the draft model's token trees (specdec.config.TreeShape; None: chains)
        self.eagle_target = eagle_target  # an EAGLE-3 head's target (its embedding and shape); the model is the head
        self.head_info: dict | None = None  # what GetInfo says of a head (set by load)
        self.compute = compute  # shared with another backend in this process (see specdec.serving.batching)
        self.tli = None
        self.lm: LoadedModel | None = None
        self.ready = threading.Event()
        self._load_started = time.monotonic()  # load() restarts it: the ready line's load_seconds
        self.load_error: Exception | None = None  # why load() failed, for callers (never retried)
        self._stop = threading.Event()
        self.batch_sizes: list[int] = []  # observed batch sizes (bounded), for tests and metrics
        self.sequences_expired = 0  # sequences released by the idle expiry (sequence_ttl_seconds)
        self.metrics = ServiceMetrics(role, model_free or config.model)
        self.draining = False  # set by drain(): no new sequence is taken on

    # -- lifecycle -----------------------------------------------------------------------------------
    def load(self) -> None:
        cfg = self.config
        self._load_started = time.monotonic()
        if self.eagle_target is not None:  # an EAGLE-3 head: no KV pool, its own per-sequence cache
            from specdec.serving.eagle_head import load_eagle_head

            self.runner, self.worker, self.head_info = load_eagle_head(cfg, self.eagle_target, self.draft_sample_method,
                                                                       self.draft_top_n, self.tree_shape)
            self.max_model_len = self.runner.max_model_len
            if self.lookup is not None:  # enable_suffix_decoding: a suffix match proposes, else the head
                self.worker = HybridDraftWorker(self.worker, self.lookup, self.model_k, self.merge_score)
            self._start(self.worker.propose_batch)
            return
        if self.model_free:  # the token histories draft: nothing to load
            self.max_model_len = cfg.max_model_len or NGRAM_MAX_MODEL_LEN
            self.runner = NgramStore(self.lookup, max_sequences=cfg.max_sequences, max_model_len=self.max_model_len)
            self.worker = NgramWorker(self.runner)
            self._start(self.worker.propose_batch)
            return
        check_kv_settings(cfg)
        logger.info("%s loading %s (dtype %s, device %s) ...", self.role, cfg.model, cfg.dtype, cfg.device,
                    extra={"role": self.role, "model": cfg.model, "dtype": cfg.dtype, "device": cfg.device})
        self.lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, revision=cfg.revision)
        if self._stop.is_set():  # the service was stopped while the model loaded
            return
        limit = model_max_len(self.lm)
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        self.runner = ModelRunner(self.lm, self.max_model_len, role=self.role, max_sequences=cfg.max_sequences,
                                  lean_forward=cfg.lean_forward, kv_cache_memory=cfg.kv_cache_memory,
                                  block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                                  gpu_memory_utilization=cfg.gpu_memory_utilization,
                                  batch_invariant=cfg.batch_invariant, quantization=cfg.quantization,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                                  max_num_partial_prefills=cfg.max_num_partial_prefills,
                                  release_unread_weights=True)  # this service's own model: one copy of each weight
        if self.role == "draft":
            self.tli = self._tli_adapter()
            self.worker = DraftWorker(self.runner, self.draft_sample_method, top_n=self.draft_top_n, tli=self.tli,
                                      tree=self.tree_shape)
            if self.lookup is not None:  # hybrid: a lookup match proposes, else the model
                self.worker = HybridDraftWorker(self.worker, self.lookup, self.model_k, self.merge_score)
            run = self.worker.propose_batch
        else:
            self.worker = TargetWorker(self.runner, kernels=cfg.kernels, seeded_sampling=self.seeded_sampling,
                                       tree_tile_rows=self.tree_tile_rows)
            run = self.worker.verify_batch
        self._start(run)

    def _scheduler_stats(self) -> dict:
        """The pass scheduler's counts, and a target's token-tree nodes cut to fit its passes."""
        stats = self.runner.scheduler.stats()
        if self.role == "target":
            stats["tree_nodes_cut"] = self.worker.tree_nodes_cut
        return stats

    def _start(self, run) -> None:
        """The batcher, the warm-up, the expiry loop; then ready."""
        cfg = self.config
        # Every forward pass runs on the batcher's compute thread (see specdec.serving.batching for why one
        # process should run its models on one thread); an own thread gets num_threads cores.
        threads = cpu_threads(cfg.num_threads)
        self.batcher = ContinuousBatcher(run, cfg.max_batch_size, name=f"{self.role}-batcher",
                                         on_batch=self._record_batch, on_batch_done=self.metrics.batch,
                                         compute=self.compute,
                                         expected=self._active_sequences, max_wait_s=cfg.batch_wait_ms / 1000,
                                         defer_to_others=self.role == "draft",
                                         decoding=self.runner.cache.decoding if self.lm is not None else None,
                                         thread_init=lambda: set_num_threads(threads))
        self._warmup()
        self.metrics.track_cached(lambda: len(self.runner.sequences))
        if self.lm is not None:  # an n-gram draft holds no KV
            self.metrics.track_kv_cache(self.runner.kv_stats)
            self.metrics.track_scheduler(self._scheduler_stats)
        if isinstance(self.lookup, SuffixCache):
            self.metrics.track_suffix_cache(self.lookup)
        if isinstance(self.worker, HybridDraftWorker):
            self.metrics.track_hybrid_rounds(self.worker.rounds)
        set_build_info(self.role, cfg.model if self.lm is not None or self.head_info else self.model_free,
                       dtype=dtype_name(self.lm.dtype) if self.lm is not None else "",
                       device=str(self.lm.device) if self.lm is not None else "cpu",
                       method=self.info()["method"] or self.draft_sample_method)
        threading.Thread(target=self._evict_loop, name=f"{self.role}-evict", daemon=True).start()
        self.ready.set()
        self._log_ready()

    def _log_ready(self) -> None:
        """One line: ready, how long loading and warming up took, what was loaded and the memory it holds
        (fields for ``--log-format json``: role, model, load_seconds, weights_bytes, resident_bytes ...)."""
        seconds = time.monotonic() - self._load_started
        resident = resident_bytes()
        fields = {"role": self.role, "load_seconds": round(seconds, 3), "resident_bytes": resident}
        if self.head_info is not None:
            logger.info("draft backend ready in %.1f s: EAGLE-3 head %s for %s (features of layers %s); resident "
                        "%.0f MiB", seconds, self.config.model, self.eagle_target, self.head_info["feature_layers"],
                        resident / 2**20, extra={**fields, "model": self.config.model})
            return
        if self.lm is None:
            logger.info("draft backend ready in %.1f s: %s drafting, no model (%s); resident %.0f MiB", seconds,
                        self.model_free, self.lookup.describe(), resident / 2**20,
                        extra={**fields, "model": self.model_free})
            return
        cfg = self.config
        runtime = "transformers forward" if self.runner.net is self.lm.model else "lean forward"
        if self.runner.vocab_subset is not None:
            runtime += f", draft vocabulary of {len(self.runner.vocab_subset)} ids"
        weights = self.runner.weight_bytes()
        self.metrics.model_weights(weights)
        logger.info("%s backend ready in %.1f s: %s (%s, vocab %d, max_model_len %d; %s); memory at start-up: "
                    "weights %.0f MiB, resident %.0f MiB", self.role, seconds, cfg.model, dtype_name(self.lm.dtype),
                    self.lm.vocab_size, self.max_model_len, runtime, weights / 2**20, resident / 2**20,
                    extra={**fields, "model": cfg.model, "dtype": dtype_name(self.lm.dtype),
                           "device": str(self.lm.device), "vocab_size": self.lm.vocab_size,
                           "max_model_len": self.max_model_len, "runtime": runtime, "weights_bytes": weights})

    def _tli_adapter(self):
        """A TLI adapter when the target's tokenizer is given and differs from the draft's."""
        if not self.target_tokenizer:
            return None
        from specdec.model_files import load_tokenizer, tokenizer_fingerprint
        from specdec.tli.adapter import TLIAdapter

        target_tok = load_tokenizer(self.target_tokenizer)
        if tokenizer_fingerprint(target_tok) == self.lm.tokenizer_fingerprint:
            return None
        # Target ids can be as large as the target tokenizer (its padded logits are never needed here).
        return TLIAdapter(self.lm.tokenizer, target_tok, max(len(target_tok), target_tok.vocab_size),
                          proposals=self.tli_proposals, kernels=self.config.kernels)

    def _warmup(self) -> None:
        sid = f"__warmup_{self.role}__"
        ids = (self.lm.tokenizer("Hello, world").input_ids or [0]) if self.lm is not None else [1, 2, 1, 2]
        params = SamplingParams(temperature=0, max_tokens=4)
        if self.role == "draft":
            self.batcher(ProposeCall(sid, ids, 2, params))
        else:
            self.batcher(VerifyCall(sid, ids, Proposal([ids[-1]]), params))
        self.worker.release(sid)

    def close(self) -> None:
        self._stop.set()
        if self.ready.is_set():
            self.batcher.close()
            self.metrics.untrack_kv_cache()

    def drain(self) -> None:
        """From now on, calls for a sequence this service does not hold get UNAVAILABLE (the gateway sends it
        to another replica); the held ones are served on until they finish (see ``live_sequences``)."""
        self.draining = True

    def live_sequences(self) -> int:
        """Sequences held and served within the last LIVE_WINDOW_S (a stream in flight calls every round; a
        sequence its gateway forgot is left to the idle expiry, not waited for)."""
        return self._active_sequences(LIVE_WINDOW_S) if self.ready.is_set() else 0

    def _active_sequences(self, window_s: float = 1.0) -> int:
        """Sequences served within the last window_s: those a batch may expect back shortly."""
        now = time.monotonic()
        with self.runner.lock:
            return sum(1 for s in self.runner.sequences.values() if now - s.last_used < window_s)

    def _record_batch(self, n: int) -> None:
        self.batch_sizes.append(n)
        del self.batch_sizes[:-1000]

    def _evict_loop(self) -> None:
        ttl = self.config.sequence_ttl_seconds
        while not self._stop.wait(min(30.0, max(ttl / 4, 0.05))):
            self.evict_idle()

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Release the sequences idle for longer than sequence_ttl_seconds (as of ``now``); their ids."""
        now = time.monotonic() if now is None else now
        ttl = self.config.sequence_ttl_seconds
        with self.runner.lock:
            stale = [sid for sid, s in self.runner.sequences.items() if now - s.last_used > ttl]
            for sid in stale:
                self.runner.release(sid)
            self.sequences_expired += len(stale)
        self.metrics.expired(len(stale))
        if stale:
            logger.info("%s: evicted %d idle sequence(s)", self.role, len(stale))
        return stale

    # -- requests ------------------------------------------------------------------------------------
    def history(self, sequence_id: str, start_position: int, new_token_ids: list[int]) -> list[int]:
        """The sequence's full token ids: the held prefix [0, start_position) + the new ones.

        A sequence the service holds gets them in one ``TokenHistory`` kept from call to call
        (``specdec.history``): it loses what follows start_position and gains the new ids, so a round costs
        the new ids, not the history, here and in the readers that keep a mark of it. Its prefix is the held
        prefix: they matched at the last call, and only what the held ids may have gained since is compared
        (held ids change only by being cut back or by taking the ids of the history returned here).
        """
        if not sequence_id:
            raise InvalidRequestError("sequence_id is empty", param="sequence_id")
        # ids arrive in target ids (an n-gram draft takes any: it only looks them up)
        vocab = (self.tli.target_vocab_size if self.tli else self.lm.vocab_size if self.lm is not None
                 else self.head_info["vocab_size"] if self.head_info else 2**31)
        bad = [t for t in new_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="new_token_ids")
        tokens = None
        if self.draining and sequence_id not in self.runner.sequences:
            raise BackendUnavailableError(f"the {self.role} service is shutting down (draining the sequences it "
                                          "holds); send new sequences to another replica")
        if start_position > 0 or sequence_id in self.runner.sequences:
            with self.runner.lock:
                seq = self.runner.sequences.get(sequence_id)
                # A TLI draft caches its own ids and a hybrid one skips the model on lookup rounds: both
                # keep the history they were sent (target ids) beside their cache.
                held_ids = ([] if seq is None else seq.state.held_target_ids if seq.state.held_target_ids is not None
                            else [] if self.tli else seq.tokens)
                if start_position > 0 and (seq is None or len(held_ids) < start_position):
                    held = len(held_ids)
                    self.metrics.cache_miss()
                    raise SequenceNotFoundError(
                        f"{self.role}: sequence {sequence_id!r} holds {held} tokens, not the {start_position} the "
                        "request builds on (restart or eviction); resend the whole history with start_position=0"
                    )
                if seq is not None:
                    # (the held ids then, the history returned then, how many leading ids they shared)
                    answered = seq.state.answered or AnsweredHistory(None, TokenHistory(), 0)
                    held_then, tokens, shared = answered.held_then, answered.tokens, answered.shared
                    if start_position == 0:
                        tokens.truncate(common_prefix(tokens, new_token_ids))
                        tokens += new_token_ids[len(tokens):]
                    else:
                        known = min(shared, start_position) if held_then is held_ids else 0
                        same = common_prefix(tokens, held_ids, known)  # bounded: the ids held since then
                        tokens.truncate(min(same, start_position))
                        tokens += held_ids[len(tokens):start_position]
                        tokens += new_token_ids
                    seq.state.answered = AnsweredHistory(held_ids, tokens, start_position)
        if tokens is None:  # a new sequence: nothing held
            tokens = TokenHistory(new_token_ids)
        if not tokens:
            raise InvalidRequestError("the sequence is empty: send at least one token", param="new_token_ids")
        return tokens

    def propose(self, call: ProposeCall, timeout: float | None = None, hint: tuple[str, int] | None = None) -> Proposal:
        """``hint``: (group, size) of the calls the caller issued together (they are batched whole)."""
        check_num_speculative_tokens(call.num_speculative_tokens, minimum=0)
        return self.batcher(call, timeout, hint)

    def verify(self, call: VerifyCall, timeout: float | None = None, hint: tuple[str, int] | None = None) -> VerifyResult:
        check_num_speculative_tokens(len(call.proposal.draft_token_ids), minimum=0)
        return self.batcher(call, timeout, hint)

    def check_feature_layers(self, layers: tuple[int, ...]) -> None:
        """InvalidRequestError unless the target has every asked layer (an EAGLE head's features)."""
        count = self.runner.num_layers
        if len(layers) > 8 or not all(0 <= i < count for i in layers):
            raise InvalidRequestError(f"feature_layers {list(layers)}: this target has {count} decoder layers "
                                      f"(ask for at most 8 of 0..{count - 1})", param="feature_layers")

    def release(self, sequence_id: str) -> bool:
        with self.runner.lock:
            return self.runner.release(sequence_id)

    def info(self) -> dict:
        lm = self.lm
        if self.head_info is not None:
            return {**self.head_info, "max_model_len": self.max_model_len, "max_sequences": self.config.max_sequences,
                    "max_num_speculative_tokens": MAX_NUM_SPECULATIVE_TOKENS, "kv_cache_capacity_tokens": 0,
                    "block_size": 0, "enable_prefix_caching": False}
        if lm is None:  # n-gram drafting: proposals are ids of the history, whatever the vocabulary
            return {"model_name": self.model_free, "vocab_size": 0, "tokenizer_fingerprint": "", "dtype": "", "device": "cpu",
                    "max_num_speculative_tokens": MAX_NUM_SPECULATIVE_TOKENS, "max_model_len": self.max_model_len,
                    "eos_token_ids": [], "model_source": "", "max_sequences": self.config.max_sequences,
                    "proposal_tokenizer_fingerprint": "", "method": self.model_free, "kv_cache_capacity_tokens": 0,
                    "block_size": 0, "enable_prefix_caching": False}
        kv = self.runner.kv_stats()
        return {
            "method": ("suffix_hybrid" if isinstance(self.lookup, SuffixCache) else "hybrid" if self.lookup is not None
                       else "draft_model" if self.role == "draft" else ""),
            "model_name": self.config.model,
            "vocab_size": lm.vocab_size,
            "tokenizer_fingerprint": lm.tokenizer_fingerprint,
            "dtype": dtype_name(lm.dtype),
            "device": str(lm.device),
            "max_num_speculative_tokens": MAX_NUM_SPECULATIVE_TOKENS,
            "max_model_len": self.max_model_len,
            "eos_token_ids": sorted(lm.eos_token_ids),
            "model_source": lm.source,
            "max_sequences": self.config.max_sequences,
            "proposal_tokenizer_fingerprint": self.tli.target_fingerprint if self.tli else lm.tokenizer_fingerprint,
            "kv_cache_capacity_tokens": kv.capacity_tokens,
            "block_size": kv.block_size,
            "enable_prefix_caching": self.config.enable_prefix_caching,
        }
