"""gRPC clients of the draft and target services, with the worker interface the loop expects.

Each client remembers the history it last sent for each sequence and sends only what follows the
part the new history shares with it (a lookahead's history carries drafts that a verification may
then replace: the shared part ends where they differ). Given the same ``TokenHistory`` again (the
loop's histories are), it compares only what changed since (``specdec.history``): a round costs the
new tokens, not the history. A service that lost the sequence answers NOT_FOUND and gets the whole history; an
unavailable service (restart) is retried until ``retry_seconds`` run out. A service whose KV pool
preempted the sequence (ABORTED: it freed the blocks and forgot it) gets the whole history again after a
short wait (20 ms, doubling up to 1 s, for at most ``preempted_retry_seconds``, the request's deadline
and the call's own deadline). Losing a cache costs a recompute, never correctness.

Every call has a deadline even when the client sent none (``gateway.deadlines``: from the backend's
measured call times, with a floor). A call that runs past its own deadline fails at once with
UNAVAILABLE naming the backend (the replica set then moves the sequence on); one that runs past the
request's deadline is DEADLINE_EXCEEDED, the client's doing, not the backend's. Whatever such a call
still does on the service cannot corrupt the sequence: the next call says where its history starts
(``start_position``), and a service holding less answers NOT_FOUND and gets the whole history.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.deadlines import CallDeadline
from specdec.errors import BackendUnavailableError, DeadlineExceededError, SequenceNotFoundError, SequencePreemptedError
from specdec.history import common_prefix, mark_of, unchanged_prefix
from specdec.proposal import Proposal, VerifyResult
from specdec.sampling_params import SamplingParams
from specdec.serving.grpc_errors import error_from_rpc
from specdec.serving.metrics import HISTORY_RESENDS, gateway_series
from specdec.serving.batching import BATCH_HINT_KEY
from specdec.serving.server import channel_options
from specdec.serving.tls import PLAINTEXT, ChannelSecurity
from specdec.features import FeatureRelay
from specdec.serving.wire import (features_from_proto, features_to_proto, logprobs_from_proto, mask_to_bytes, probs_from_proto, probs_to_proto,
                                  sampling_to_proto)
from specdec.v1 import common_pb2, draft_service_pb2, draft_service_pb2_grpc, target_service_pb2, target_service_pb2_grpc

logger = logging.getLogger(__name__)

_DRAFT_METHODS = {
    "greedy": draft_service_pb2.DRAFT_SAMPLE_METHOD_GREEDY,
    "probabilistic": draft_service_pb2.DRAFT_SAMPLE_METHOD_PROBABILISTIC,
}

# Waits before resending a preempted sequence: the first, and the longest (it doubles in between).
PREEMPTED_FIRST_DELAY = 0.02
PREEMPTED_MAX_DELAY = 1.0
# A call's own deadline before the gateway's settings are applied (GatewayConfig's defaults).
DEFAULT_CALL_TIMEOUT_FLOOR = 10.0
DEFAULT_CALL_TIMEOUT_FACTOR = 8.0

# The batch hint of the calls this thread makes now ("<group>:<size>", see gateway.scheduler).
_BATCH_HINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("specdec_batch_hint", default=None)


@contextlib.contextmanager
def batch_hint(hint: str | None) -> Iterator[None]:
    """Calls made inside carry ``hint`` as their batch hint metadata."""
    token = _BATCH_HINT.set(hint)
    try:
        yield
    finally:
        _BATCH_HINT.reset(token)


def _metadata() -> dict:
    """The call's metadata keyword: the batch hint, when one is set."""
    hint = _BATCH_HINT.get()
    return {} if hint is None else {"metadata": ((BATCH_HINT_KEY, hint),)}


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    return common_prefix(a, b)


class SentHistory:
    """What this client last sent of one sequence (what the service holds), kept in place."""

    __slots__ = ("ids", "source", "mark", "version")

    def __init__(self):
        self.ids: list[int] = []  # the history last sent (this client's own copy)
        self.source = None  # the TokenHistory it was read from, if it was one ...
        self.mark = None  # ... and that history's mark then: what is unchanged since is not compared again
        self.version = 0  # bumped by each update (a concurrent call's result is not patched in blindly)

    def start(self, token_ids: list[int]) -> int:
        """Where ``token_ids`` stops sharing the history last sent (only what changed since is compared)."""
        known = min(unchanged_prefix(self.source, self.mark, token_ids), len(self.ids))
        return common_prefix(self.ids, token_ids, known)

    def forget(self) -> None:
        """The service holds nothing of the sequence any more."""
        del self.ids[:]
        self.source = self.mark = None
        self.version += 1

    def sent(self, token_ids: list[int], start: int, new: list[int], version: int, source, mark) -> None:
        """The service now holds ``token_ids`` (= ids[:start] + new, as read when ``version`` was current)."""
        if version == self.version:
            del self.ids[start:]
            self.ids += new
        else:  # another call for the sequence got in between: the last one to finish wins, as a whole
            self.ids = list(token_ids)
            source = mark = None
        self.source, self.mark = source, mark
        self.version += 1


class _RemoteBackend:
    role = "backend"
    phase = "call"  # the metrics' name of the round phase this service runs
    model_name = ""  # the gateway's served model name (a metrics label), set by the gateway

    def __init__(self, address: str, retry_seconds: float = 60.0, security: ChannelSecurity = PLAINTEXT):
        self.address = address
        self.channel = security.channel(address, options=channel_options())  # TLS per --backend-tls-*
        self.retry_seconds = retry_seconds
        # how long a call may keep resending a sequence its service preempted (KV pool full)
        self.preempted_retry_seconds = retry_seconds
        self._held: dict[str, SentHistory] = {}  # sequence id -> the history last sent (the service holds it)
        self._lock = threading.Lock()
        self._deadlines: dict[str, float] = {}  # sequence id -> the request's deadline (monotonic)
        self.call_timeout: float | None = None  # a cap on each call's deadline (the draft's, with fallback)
        # each call's own deadline, from this backend's measured call times (see gateway.deadlines)
        self.call_deadline = CallDeadline(DEFAULT_CALL_TIMEOUT_FLOOR, DEFAULT_CALL_TIMEOUT_FACTOR)
        self.stop_retrying: Callable[[], bool] = lambda: False  # e.g. the target is known down
        # no call at all while this returns True (the one target is known down: a clean UNAVAILABLE at once, not
        # another deadline's wait); replicas keep it False and hand the sequence on instead
        self.fail_fast: Callable[[], bool] = lambda: False
        self.on_unavailable: Callable[[], None] = lambda: None  # called when retries ran out
        # (phase, k, seconds) of each successful Propose / Verify: adaptive k keeps its costs current with it
        self.on_call_time: Callable[[str, int, float], None] | None = None

    def set_deadline(self, sequence_id: str, deadline: float | None) -> None:
        """Propagate the client's deadline: every call for this sequence gets the time left."""
        if deadline is not None:
            self._deadlines[sequence_id] = deadline

    def _timeout(self, sequence_id: str, tokens: int) -> tuple[float, bool]:
        """The call's timeout, and whether it is the request's deadline (not the call's own): what is left of
        the request's deadline, capped by the call's own deadline for ``tokens`` tokens and ``call_timeout``."""
        own = self.call_deadline.timeout(tokens)
        if self.call_timeout is not None:
            own = min(own, self.call_timeout)
        deadline = self._deadlines.get(sequence_id)
        if deadline is None:
            return own, False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(f"{self.role} service: the request's deadline passed")
        return (remaining, True) if remaining < own else (own, False)

    def _call(self, rpc, make_request: Callable[[int, list[int]], object], sequence_id: str, token_ids: list[int]):
        with self._lock:
            # Known from the first attempt on: a first call that fails after the service created the
            # sequence (deadline, cancel) must still be released, not left to the idle expiry.
            held = self._held.get(sequence_id)
            if held is None:
                held = self._held[sequence_id] = SentHistory()
            start = held.start(token_ids)
            version = held.version
            source, mark = mark_of(token_ids)
            new = token_ids[start:]
        began_call = time.monotonic()
        give_up = began_call + self.retry_seconds
        delay = 0.05
        preempted_delay = PREEMPTED_FIRST_DELAY
        while True:
            if self.fail_fast():
                raise BackendUnavailableError(f"{self.role} service at {self.address} is down (it did not answer "
                                              "a call within its deadline); retry shortly")
            try:
                began = time.monotonic()
                timeout, request_bound = self._timeout(sequence_id, len(new))
                response = rpc(make_request(start, new), timeout=timeout, **_metadata())
                took = time.monotonic() - began
                self.call_deadline.observe(took, len(new))
                gateway_series(self.model_name).call(self.phase).observe(took)
                with self._lock:
                    held.sent(token_ids, start, new, version, source, mark)
                    self._held[sequence_id] = held
                return response
            except grpc.RpcError as err:
                error = error_from_rpc(err, f"{self.role} service: ")
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not request_bound:
                    # the backend did not answer within its own deadline: hung or stuck, not merely busy
                    logger.error("%s service at %s did not answer %s of %s within %.1f s", self.role, self.address,
                                 self.phase, sequence_id, timeout)
                    self.on_unavailable()
                    raise BackendUnavailableError(
                        f"{self.role} service at {self.address} did not answer within {timeout:.1f} s (hung or "
                        "stuck; the deadline is --backend-call-timeout-factor x its recent call time, at least "
                        "--backend-call-timeout-floor-seconds); retry shortly") from None
                if isinstance(error, SequenceNotFoundError) and start > 0:
                    logger.info("%s lost sequence %s; resending its %d tokens", self.role, sequence_id, len(token_ids))
                    HISTORY_RESENDS.labels("gateway", self.model_name, self.phase).inc()
                    start, new = 0, list(token_ids)
                    continue
                if isinstance(error, SequencePreemptedError):
                    with self._lock:  # the service freed the sequence's blocks and forgot it
                        held.forget()
                        version = held.version
                    start, new = 0, list(token_ids)
                    if self._preempted_wait(sequence_id, began_call, preempted_delay):
                        logger.info("%s preempted sequence %s; resending its %d tokens", self.role, sequence_id,
                                    len(token_ids))
                        HISTORY_RESENDS.labels("gateway", self.model_name, self.phase).inc()
                        preempted_delay = min(2 * preempted_delay, PREEMPTED_MAX_DELAY)
                        continue
                    raise error from None
                if type(error) is BackendUnavailableError and err.code() == grpc.StatusCode.UNAVAILABLE:
                    if time.monotonic() < give_up and not self.stop_retrying():
                        time.sleep(delay)
                        delay = min(delay * 2, 1.0)
                        continue
                    self.on_unavailable()
                raise error from None

    def _preempted_wait(self, sequence_id: str, began: float, delay: float) -> bool:
        """Sleep ``delay`` before resending a preempted sequence, if that leaves time for the resend: within
        preempted_retry_seconds of the call's start, the call's own deadline (call_timeout: the draft's, with
        the fallback on) and the request's deadline. False: give up now."""
        now = time.monotonic()
        limits = [began + self.preempted_retry_seconds]
        if self.call_timeout is not None:
            limits.append(began + self.call_timeout)
        deadline = self._deadlines.get(sequence_id)
        if deadline is not None:
            limits.append(deadline)
        if now + delay >= min(limits):
            return False
        time.sleep(delay)
        return True

    def forget(self, sequence_id: str) -> None:
        """Drop what this client knows of the sequence, without a call (the service is gone)."""
        with self._lock:
            self._held.pop(sequence_id, None)
            self._deadlines.pop(sequence_id, None)

    def release(self, sequence_id: str) -> None:
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.drop(sequence_id)
        with self._lock:
            held = self._held.pop(sequence_id, None)
            self._deadlines.pop(sequence_id, None)
        if held is None:
            return
        # Not waited for: a hung service must not hold up the request that is leaving (its error, or its end).
        future = self._stub.ReleaseSequence.future(common_pb2.ReleaseSequenceRequest(sequence_id=sequence_id), timeout=5)
        future.add_done_callback(lambda f: self._released(f, sequence_id))

    def _released(self, future, sequence_id: str) -> None:
        if future.cancelled():
            return
        err = future.exception()
        if err is not None:  # the idle-expiry on the service cleans up eventually
            code = err.code().name if isinstance(err, grpc.RpcError) else type(err).__name__
            logger.warning("%s: release of %s failed: %s", self.role, sequence_id, code)

    def get_info(self, timeout: float) -> common_pb2.ModelInfo:
        """Wait (up to timeout) until the service is loaded and answers GetInfo."""
        give_up = time.monotonic() + timeout
        while True:
            try:
                return self._stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).info
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or time.monotonic() > give_up:
                    raise BackendUnavailableError(
                        f"{self.role} service at {self.address} did not answer GetInfo: {err.code().name} {err.details()}"
                    ) from None
                time.sleep(0.5)

    def is_serving(self, timeout: float = 2.0) -> bool:
        try:
            resp = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()


class RemoteDraft(_RemoteBackend):
    role = "draft"
    phase = "propose"

    def __init__(self, address: str, draft_sample_method: str = "greedy", retry_seconds: float = 60.0,
                 security: ChannelSecurity = PLAINTEXT, relay: FeatureRelay | None = None):
        super().__init__(address, retry_seconds, security)
        self._stub = draft_service_pb2_grpc.DraftServiceStub(self.channel)
        self.relay = relay  # an EAGLE draft's features from the target (used once its layers are set)
        self.draft_sample_method = _DRAFT_METHODS[draft_sample_method]
        self.vocab_size = 0  # set at start-up from the TARGET's info: q rows are over target ids

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: SamplingParams) -> Proposal:
        sampling = sampling_to_proto(params)
        relay = self.relay if self.relay is not None and self.relay.layers else None
        features = [features_to_proto(c) for c in relay.pending(sequence_id)] if relay else []

        def make(start: int, new: list[int]):
            return draft_service_pb2.ProposeRequest(
                sequence_id=sequence_id, start_position=start, new_token_ids=new,
                num_speculative_tokens=num_speculative_tokens, sampling_params=sampling,
                draft_sample_method=self.draft_sample_method, features=features,
            )

        began = time.monotonic()
        resp = self._call(self._stub.Propose, make, sequence_id, token_ids)
        if relay is not None and resp.HasField("features_from"):
            relay.acknowledge(sequence_id, resp.features_from)
        if self.on_call_time is not None:
            self.on_call_time(self.phase, num_speculative_tokens, time.monotonic() - began)
        return RemoteProposal(list(resp.draft_token_ids), list(resp.draft_probs), self.vocab_size,
                              list(resp.draft_parents) or None)


class RemoteProposal(Proposal):
    """A proposal as the draft service sent it. The gateway only forwards q, so it stays in its wire
    form (sparse rows) on its way to the target; ``draft_probs`` decodes it only if someone asks."""

    def __init__(self, draft_token_ids: list[int], wire_probs: list, vocab_size: int,
                 parents: list[int] | None = None):
        self.draft_token_ids = draft_token_ids
        self.wire_probs = wire_probs
        self._vocab_size = vocab_size
        self.parents = parents  # a token tree's (specdec.trees), forwarded as it came

    @property
    def draft_probs(self):  # type: ignore[override]
        return probs_from_proto(self.wire_probs, len(self.draft_token_ids), self._vocab_size)

    def truncated(self, n: int) -> Proposal:
        if len(self.draft_token_ids) <= n:
            return self
        return RemoteProposal(self.draft_token_ids[:n], self.wire_probs[:n], self._vocab_size,
                              None if self.parents is None else self.parents[:n])


class RemoteTarget(_RemoteBackend):
    role = "target"
    phase = "verify"

    def __init__(self, address: str, retry_seconds: float = 60.0, security: ChannelSecurity = PLAINTEXT,
                 relay: FeatureRelay | None = None):
        super().__init__(address, retry_seconds, security)
        self._stub = target_service_pb2_grpc.TargetServiceStub(self.channel)
        self.relay = relay  # asks for an EAGLE draft's features (once the relay's layers are set)

    def verify(self, sequence_id: str, token_ids: list[int], proposal: Proposal, params: SamplingParams) -> VerifyResult:
        sampling = sampling_to_proto(params)
        probs = proposal.wire_probs if isinstance(proposal, RemoteProposal) else probs_to_proto(proposal.draft_probs)
        mask = mask_to_bytes(proposal.token_bitmask)
        relay = self.relay if self.relay is not None and self.relay.layers else None
        feature_start = relay.verify_from(sequence_id) if relay else 0

        def make(start: int, new: list[int]):
            return target_service_pb2.VerifyRequest(
                sequence_id=sequence_id, start_position=start, new_token_ids=new,
                draft_token_ids=proposal.draft_token_ids, draft_probs=probs, sampling_params=sampling,
                logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,  # None: unset, not computed
                token_bitmask=mask, feature_layers=relay.layers if relay else (), feature_start=feature_start,
                draft_parents=proposal.parents if proposal.is_tree else (),
            )

        began = time.monotonic()
        resp = self._call(self._stub.Verify, make, sequence_id, token_ids)
        if relay is not None and resp.HasField("features"):
            relay.put(sequence_id, features_from_proto(resp.features))
            gateway_series(self.model_name).feature_bytes.inc(len(resp.features.data))
        if self.on_call_time is not None:
            self.on_call_time(self.phase, len(proposal.draft_token_ids), time.monotonic() - began)
        next_token = resp.bonus_token_id if resp.WhichOneof("next_token") == "bonus_token_id" else resp.recovered_token_id
        return VerifyResult(resp.num_accepted_tokens, next_token,
                            logprobs_from_proto(resp.logprobs) if params.logprobs is not None else None,
                            logprobs_from_proto(resp.prompt_logprobs) if params.prompt_logprobs is not None else None,
                            accepted_path=list(resp.accepted_path) if proposal.is_tree else None)
