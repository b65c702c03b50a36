"""The gateway's request handling, shared by its gRPC and HTTP front ends (no protobuf here)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gateway.clients import RemoteDraft, RemoteTarget
from gateway.config import GatewayConfig
from gateway.deadlines import CallDeadline
from gateway.replicas import ReplicaSet, is_replica_spec
from gateway.resilience import Admission, CircuitBreaker, FallbackDraft, SheddingDraft, TargetHealth
from gateway.scheduler import RoundScheduler
from specdec.adaptive import AdaptiveK, RoundCosts, calibrate
from specdec.config import FEATURE_METHODS, MODEL_FREE_METHODS, SpeculativeConfig, check_vocab_compatible
from specdec.decoding import Lookahead, decode
from specdec.features import FeatureRelay
from specdec.proposal import TokenLogprob, check_num_speculative_tokens
from specdec.errors import BackendUnavailableError, ConfigError, InvalidRequestError, SpecDecError
from specdec.model_files import load_tokenizer
from specdec.sampling_params import SamplingParams
from specdec.sequence import SequenceState
from specdec.structured import GrammarCompiler
from specdec.serving import metrics
from specdec.serving.metrics import SequenceMetrics, init_gateway_series, set_build_info
from specdec.serving.tls import channel_security

logger = logging.getLogger(__name__)
SCHEDULING_POLICIES = ("fcfs", "priority")  # --scheduling-policy (vLLM's)
request_log = logging.getLogger("specdec.requests")  # one line per finished sequence
CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog. A round's cost is measured on this text."


@dataclass
class Delta:
    """What one speculative round added to a sequence."""

    text: str
    token_ids: list[int]
    finished: bool
    logprobs: list[TokenLogprob] | None = None  # one per token_ids when the request asked for logprobs


class Gateway:
    """Owns each request's canonical token sequence and runs the speculative loop over the services."""

    def __init__(self, config: GatewayConfig):
        check_num_speculative_tokens(config.num_speculative_tokens)
        self.config = config
        timeout = config.backend_timeout_seconds
        security = channel_security(config.backend_tls_ca_file, config.backend_tls_cert_file,
                                    config.backend_tls_key_file, config.backend_tls_server_name)
        def own_deadline(client):  # each backend (each replica) learns its own call times
            client.call_deadline = CallDeadline(config.backend_call_timeout_floor_seconds,
                                                config.backend_call_timeout_factor)
            return client

        self.draining = False  # set by drain(): new requests are refused (503 / UNAVAILABLE)
        refresh = config.dns_refresh_seconds
        # an EAGLE draft's features: from the target's Verify to the draft's next Propose (its layers are set
        # once the draft's GetInfo names them; until then, and for any other draft, nothing is asked)
        self.relay = FeatureRelay(())
        self.target = _client(config.target_addr, lambda addr: own_deadline(
                              RemoteTarget(addr, timeout, security, relay=self.relay)), refresh)
        self.draft = (_client(config.draft_addr, lambda addr: own_deadline(
                              RemoteDraft(addr, config.draft_sample_method, timeout, security, relay=self.relay)),
                              refresh)
                      if config.draft_addr else None)
        if config.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{config.scheduling_policy!r}")
        self.admission = Admission(config.max_concurrent_requests, config.max_queue_len, config.max_queue_time_seconds)
        try:
            self.target_info = self.target.get_info(config.startup_timeout_seconds)
            self.draft_info = self.draft.get_info(config.startup_timeout_seconds) if self.draft else None
            self._check_pair()
        except BaseException:
            self.close()
            raise
        self.tokenizer = load_tokenizer(config.tokenizer or self.target_info.model_name)
        self.eos_token_ids = frozenset(self.target_info.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.target_info.vocab_size, self.eos_token_ids)
        same_vocab = self.draft_info and self.draft_info.tokenizer_fingerprint == self.target_info.tokenizer_fingerprint
        # A TLI draft counts its own tokens against its own limit; only a same-vocabulary draft caps the length.
        limits = [self.target_info.max_model_len] + ([self.draft_info.max_model_len] if same_vocab else [])
        self.max_model_len = min(limits + ([config.max_model_len] if config.max_model_len else []))
        self._init_kv_budget(same_vocab)
        for client in (self.target, self.draft):
            if client is not None:
                client.model_name = self.served_model_name
        init_gateway_series(self.served_model_name)
        name = self.served_model_name
        self.admission.on_refused = lambda reason: metrics.request_refused(name, reason)
        self.target_health = TargetHealth(self.target, on_change=lambda up: metrics.target_available(name, up))
        self.target.on_unavailable = self.target_health.mark_down
        self.target.stop_retrying = lambda: self.target_health.down
        if hasattr(self.target, "fail_fast"):  # one target (not replicas, which hand a sequence on to another)
            self.target.fail_fast = lambda: self.target_health.down
        draft_client = self.draft
        if self.draft is not None and config.draft_fallback:
            # fail fast and carry on without drafts, rather than wait out retries of a draft that is gone
            self.draft.retry_seconds = 0.0
            breaker = CircuitBreaker(config.draft_breaker_failures, config.draft_breaker_reset_seconds,
                                     on_change=lambda old, new: metrics.breaker_changed(name, old, new))
            timeout = None if config.draft_timeout_ms is None else config.draft_timeout_ms / 1000
            self.draft = FallbackDraft(self.draft, breaker, name, timeout)
        self.round_costs = self._calibrate(draft_client) if config.adaptive_k and self.draft is not None else None
        self.round_draft = self.draft  # what the rounds propose with: under load, possibly nothing
        if self.draft is not None and config.disable_by_batch_size:
            self.round_draft = SheddingDraft(self.draft, lambda: self.admission.running, config.disable_by_batch_size,
                                             name)
        # Group scheduling (gateway.scheduler): its batch hints are exact only when each phase goes to one service.
        overlap = config.overlap and self.draft is not None
        self.scheduler = (RoundScheduler(self.round_draft, self.target, config.max_concurrent_requests,
                                         hints=not any(isinstance(c, ReplicaSet) for c in (self.target, draft_client)),
                                         overlap=overlap, min_stall_seconds=config.group_stall_seconds)
                          if config.group_rounds else None)
        # overlapped drafting in one loop per request: each loop's lookahead Propose runs on this pool
        self._ahead_pool = (ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="lookahead")
                            if overlap and self.scheduler is None else None)
        set_build_info("gateway", self.served_model_name, num_speculative_tokens=config.num_speculative_tokens
                       if self.draft else 0, method=self.speculative_method)

    def _check_pair(self) -> None:
        t, d = self.target_info, self.draft_info
        if d is None:
            return
        cfg = SpeculativeConfig(model=d.model_name, num_speculative_tokens=self.config.num_speculative_tokens,
                                use_heterogeneous_vocab=self.config.use_heterogeneous_vocab,
                                draft_sample_method=self.config.draft_sample_method)
        if d.method not in MODEL_FREE_METHODS and check_vocab_compatible(t.tokenizer_fingerprint, d.tokenizer_fingerprint,
                                                          t.model_name, d.model_name, cfg) \
                and d.proposal_tokenizer_fingerprint != t.tokenizer_fingerprint:  # (n-gram: any vocabulary)
            raise ConfigError(
                f"draft {d.model_name!r} has another vocabulary than target {t.model_name!r} and does not draft in "
                f"target ids: start the draft service with --target-tokenizer {t.model_name!r} "
                "(env SPECDEC_DRAFT_TARGET_TOKENIZER) to enable Token-Level Intersection")
        if d.method in FEATURE_METHODS:
            if self.config.use_heterogeneous_vocab:
                raise ConfigError(f"the draft is an EAGLE head ({d.method}): it drafts in the target's own ids from its "
                                  "hidden states, never for another vocabulary (--no-use-heterogeneous-vocab)")
            if self.config.overlap:
                raise ConfigError(f"the draft is an EAGLE head ({d.method}): it drafts from the features of the round "
                                  "just verified, so it cannot draft during that verification (--no-overlap)")
            self.relay.layers = tuple(d.feature_layers)
        k = self.config.num_speculative_tokens
        if k > min(t.max_num_speculative_tokens, d.max_num_speculative_tokens):
            raise ConfigError(f"num_speculative_tokens={k} exceeds what the services accept "
                              f"(target {t.max_num_speculative_tokens}, draft {d.max_num_speculative_tokens})")
        self.draft.vocab_size = t.vocab_size
        logger.info("serving target %s with draft %s, k=%d", t.model_name, d.model_name, k)

    def _init_kv_budget(self, same_vocab: bool) -> None:
        """The backends' KV cache pools (GetInfo's kv_cache_capacity_tokens; 0: unlimited, e.g. an n-gram draft):
        one sequence must fit the smallest pool (``kv_capacity``, with the service that has it), and running
        sequences share a pool per replica (the admission's budget). A TLI draft counts its own tokens: only
        the target and a same-vocabulary draft count here."""
        pools = [("target", self.target, self.target_info.kv_cache_capacity_tokens)]
        if same_vocab:
            pools.append(("draft", self.draft, self.draft_info.kv_cache_capacity_tokens))
        pools = [(role, client, cap) for role, client, cap in pools if cap > 0]
        self.kv_capacity, self.kv_capacity_service = min(((cap, role) for role, _, cap in pools), default=(0, ""))

        def budget() -> int:
            return min((cap * len(getattr(client, "replicas", None) or [client]) for _, client, cap in pools),
                       default=0)

        self.admission.kv_budget = budget
        if self.kv_capacity and self.kv_capacity < self.max_model_len:
            logger.warning("the %s's KV cache holds %d tokens, fewer than max_model_len %d: longer requests are "
                           "refused, and a sequence without max_tokens stops at %d tokens (raise --kv-cache-memory "
                           "of the %s service to lift it)", self.kv_capacity_service, self.kv_capacity,
                           self.max_model_len, self.kv_capacity, self.kv_capacity_service)

    def _check_kv_capacity(self, prompt_tokens: int, max_tokens: int | None) -> None:
        """400 for a request that could never fit the smallest KV cache pool, naming the numbers and the flag."""
        cap, service = self.kv_capacity, self.kv_capacity_service
        if not cap:
            return
        flag = (f"--kv-cache-memory of the {service} service (SPECDEC_{service.upper()}_KV_CACHE_MEMORY; "
                f"--{'draft-' if service == 'draft' else ''}kv-cache-memory of specdec serve)")
        if max_tokens is not None and prompt_tokens + max_tokens > cap:
            raise InvalidRequestError(
                f"the prompt's {prompt_tokens} tokens + max_tokens={max_tokens} need {prompt_tokens + max_tokens} "
                f"tokens of KV cache, but the {service}'s KV cache holds {cap} tokens in all; lower max_tokens or "
                f"shorten the prompt, or raise {flag}", param="max_tokens")
        if prompt_tokens >= cap:
            raise InvalidRequestError(
                f"the prompt has {prompt_tokens} tokens, but the {service}'s KV cache holds {cap} tokens in all, "
                f"which leaves no room to generate; shorten the prompt, or raise {flag}", param="prompt")

    def _calibrate(self, draft_client) -> RoundCosts | None:
        """Adaptive k's round costs: measured now on a scratch sequence, then kept current by every call."""
        k_max = self.config.num_speculative_tokens
        try:
            costs = calibrate(self.draft, self.target, self.tokenize(CALIBRATION_TEXT), k_max)
        except SpecDecError as exc:  # e.g. the draft is not up yet: fixed k until a restart
            logger.warning("adaptive k is off: measuring the round costs failed (%s)", exc)
            return None
        # Verify times keep the target's costs current, and Propose times the draft's when a model drafts every
        # round. Not with lookups (hybrid, n-gram): a round a lookup answered costs next to nothing and would
        # teach that drafting is free (measured: hybrid then stuck at the largest k).
        self.target.on_call_time = costs.observe
        if self.draft_info.method == "draft_model":
            draft_client.on_call_time = costs.observe
        logger.info("adaptive k up to %d; round costs (ms) verify %s, propose %s", k_max,
                    [round(1000 * v, 1) for v in costs.verify], [round(1000 * p, 1) for p in costs.propose])
        return costs

    @property
    def speculative_method(self) -> str:
        """How this gateway drafts, as its draft service says (GetInfo): draft_model, ngram or hybrid; target_only
        without a draft service (``--draft-addr none``)."""
        if self.draft_info is None:
            return "target_only"
        return self.draft_info.method or "draft_model"

    @property
    def model_name(self) -> str:
        return self.target_info.model_name

    @property
    def served_model_name(self) -> str:
        """The model id clients send (and the metrics' model_name label)."""
        return self.config.served_model_name or self.target_info.model_name

    # -- requests ------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def new_sequence(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0) -> SequenceState:
        if priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority={priority} needs a server started with --scheduling-policy priority "
                                      f"(this one schedules {self.config.scheduling_policy}); send priority 0 or "
                                      "leave it out", param="priority")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}, which leaves "
                "no room to generate; shorten the prompt", param="prompt")
        vocab = self.target_info.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        for param, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                           ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{param} names token ids {bad[:5]} outside the vocabulary [0, {vocab})",
                                          param=param)
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} is more than the context leaves: max_model_len is "
                f"{self.max_model_len} and the prompt has {len(prompt_token_ids)} tokens, so at most {room} can be "
                "generated; lower max_tokens or shorten the prompt", param="max_tokens")
        self._check_kv_capacity(len(prompt_token_ids), params.max_tokens)
        constraint = self.grammars.constraint(params.structured_outputs)  # a 400 for a grammar that cannot compile
        if self.draining:
            raise BackendUnavailableError("this gateway is shutting down (draining its requests in flight); retry: "
                                          "another replica will serve it")
        self.target_health.check()  # 503 at once while the target is known down
        self.admission.reserve(1)  # 429 at once when the queue is full
        # a sequence never outgrows the smallest KV cache pool: without max_tokens it stops there ("length")
        max_len = min(self.max_model_len, self.kv_capacity or self.max_model_len)
        if priority != params.priority:
            params = params.clone(priority=priority)  # travels with every call: the services schedule by it too
        seq = SequenceState(prompt_token_ids=list(prompt_token_ids), params=params, tokenizer=self.tokenizer,
                            eos_token_ids=self.eos_token_ids, max_model_len=max_len, constraint=constraint)
        # the reservation goes back if the sequence is dropped without being streamed
        seq.admission_ticket = weakref.finalize(seq, self.admission.cancel)
        seq.priority = priority
        if request_id:
            seq.sequence_id = f"{request_id}-{seq.sequence_id[:8]}"
        return seq

    def resolve_k(self, k: int | None) -> int | AdaptiveK:
        """A request's k (0: no speculation for it), or the configured one: with adaptive k, a policy that
        picks each round's k up to it."""
        if k is None:
            if self.round_costs is not None:
                return AdaptiveK(self.round_costs, self.config.num_speculative_tokens)
            return self.config.num_speculative_tokens
        check_num_speculative_tokens(k, minimum=0)
        return k

    def stream(self, seq: SequenceState, k: int | None = None, deadline: float | None = None,
               cancelled: Callable[[], bool] | None = None) -> Iterator[Delta]:
        """Run the loop; yield what each round added. Closing the iterator, or ``cancelled()``
        turning true (checked every round), stops it and releases both services' caches."""
        k = self.resolve_k(k)
        # a request's prompt counts once, with its first output (as in usage.prompt_tokens)
        seq_metrics = SequenceMetrics(self.served_model_name, seq.arrival_time,
                                      len(seq.prompt_token_ids) if seq.output_index == 0 else 0)
        try:
            size = self._start(seq)  # waits for a running slot and KV room (up to max_queue_time_seconds)
        except BaseException:
            seq_metrics.closed()
            raise
        for client in (self.target, self.draft):
            if client is not None:
                client.set_deadline(seq.sequence_id, deadline)
        ahead = Lookahead(self._ahead_pool.submit) if self._ahead_pool is not None else None
        rounds = (self.scheduler.rounds(seq, k, cancelled) if self.scheduler is not None
                  else _solo_rounds(decode(self.round_draft, self.target, seq, k, ahead), seq))
        try:
            seq_metrics.round_started()  # the first round starts now; the loop runs them back to back
            logprobs_seen = 0  # the tokens' logprobs, in step with the rounds' token ids
            for text, new_ids, finished in rounds:
                new_logprobs = None
                if seq.logprobs is not None:
                    new_logprobs = seq.logprobs[logprobs_seen: logprobs_seen + len(new_ids)]
                    logprobs_seen += len(new_ids)
                seq_metrics.round_done(seq.stats, len(new_ids))
                if finished:
                    seq_metrics.finished(seq.finish_reason, len(seq.output_token_ids))
                    self._log_finished(seq, seq_metrics)
                if cancelled is not None and cancelled():
                    break
                yield Delta(text, new_ids, finished, new_logprobs)
        finally:
            rounds.close()
            seq_metrics.closed()
            self.admission.finish(size)
            if seq.constraint is not None:
                stats = seq.constraint.stats
                metrics.structured_output_finished(self.served_model_name, seq.params.structured_outputs.kind,
                                                   stats.num_forced_tokens, stats.num_invalid_drafts)

    def _start(self, seq: SequenceState):
        """Turn the sequence's reservation (taken by new_sequence) into a running slot, once its prompt fits
        in the KV cache beside the running sequences; returns its size (tokens) for ``admission.finish``."""
        ticket = getattr(seq, "admission_ticket", None)
        if ticket is None or ticket.detach() is None:
            self.admission.reserve(1)  # not made by new_sequence (or already given back)

        def size() -> int:
            return len(seq.token_ids)

        self.admission.start(size, seq.priority)
        return size

    def _log_finished(self, seq: SequenceState, seq_metrics: SequenceMetrics) -> None:
        """One structured line per finished sequence (the prompt's text only with --log-requests)."""
        s = seq.stats
        fields = {"request_id": seq.sequence_id, "prompt_tokens": len(seq.prompt_token_ids),
                  "generated_tokens": len(seq.output_token_ids), "finish_reason": seq.finish_reason,
                  "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
                  "acceptance_rate": round(s.acceptance_rate, 4), "ttft_seconds": round(seq_metrics.ttft or 0.0, 6),
                  "e2e_seconds": round(seq_metrics.e2e or 0.0, 6)}
        if self.config.log_requests:
            fields["prompt"] = self.tokenizer.decode(seq.prompt_token_ids)
        request_log.info("request %s finished (%s): %d prompt + %d generated tokens, acceptance %.2f, ttft %.3f s, "
                         "e2e %.3f s", seq.sequence_id, seq.finish_reason, fields["prompt_tokens"],
                         fields["generated_tokens"], s.acceptance_rate, fields["ttft_seconds"],
                         fields["e2e_seconds"], extra=fields)

    def check_backends(self) -> tuple[list[str], list[str]]:
        """(problems, degradations): a backend that is not serving is a problem (the gateway is not
        ready), except the draft when the fallback is on, which only degrades it (rounds verify
        without drafts)."""
        problems, degraded = [], []
        for client in (self.target, self.draft):
            if client is not None and not client.is_serving():
                message = f"{client.role} service at {client.address} is not serving"
                if client is self.draft and isinstance(client, FallbackDraft):
                    degraded.append(message + ": verifying without drafts")
                else:
                    problems.append(message)
        return problems, degraded

    def drain(self) -> None:
        """Refuse new requests from now on; those in flight carry on (see ``in_flight``)."""
        self.draining = True

    def in_flight(self) -> int:
        """Sequences running or waiting for a slot."""
        return self.admission.running + self.admission.waiting

    def close(self) -> None:
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.close()
        if getattr(self, "_ahead_pool", None) is not None:
            self._ahead_pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "target_health"):
            self.target_health.close()
        self.target.close()
        if self.draft:
            self.draft.close()


def _solo_rounds(rounds: Iterator[str], seq: SequenceState) -> Iterator[tuple[str, list[int], bool]]:
    """A request's own loop (``decode``), as the scheduler's (text, new token ids, finished) rounds."""
    seen = 0
    try:
        for text in rounds:
            new_ids = seq.output_token_ids[seen:]
            seen = len(seq.output_token_ids)
            yield text, new_ids, seq.finished
    finally:
        rounds.close()


def _client(spec: str, make, dns_refresh_seconds: float):
    """One backend client, or a ReplicaSet when the address names several replicas."""
    return ReplicaSet(spec, make, refresh_seconds=dns_refresh_seconds) if is_replica_spec(spec) else make(spec)


def deadline_from_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout
