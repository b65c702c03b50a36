"""GenerationService servicer: protobuf ↔ Gateway, nothing more."""

from __future__ import annotations

import json

import grpc

from gateway.config import GatewayConfig, https_settings, with_speculative_config
from gateway.generation import Gateway, deadline_from_timeout
from gateway.limits import check_request_limits
from specdec.errors import InvalidRequestError
from specdec.serving.auth import ApiKeyInterceptor, ApiKeys
from specdec.serving.grpc_errors import map_errors, map_stream_errors, status_code_for
from specdec.serving.metrics import request_error
from specdec.serving.server import ServerHandle, start_metrics_server, start_server, time_remaining
from specdec.serving.tls import server_credentials_from
from specdec.serving.wire import (UndecodableRequest, lenient_parser, logprobs_to_proto, optional_field,
                                  sampling_from_proto)
from specdec.sequence import SequenceState
from specdec.structured import StructuredOutputsParams
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc

SPARE_WORKERS = 16  # gRPC workers beyond the admission's running + queued calls (see create_server)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


def _stats(seq: SequenceState) -> common_pb2.SpecDecodeStats:
    s = seq.stats
    return common_pb2.SpecDecodeStats(
        num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
        num_target_passes=s.num_target_passes, acceptance_rate=s.acceptance_rate,
        mean_acceptance_length=s.mean_acceptance_length,
    )


def structured_from_proto(request: pb.GenerateRequest) -> StructuredOutputsParams | None:
    """GenerateRequest.structured_outputs as the library's params (None: unset)."""
    if not request.HasField("structured_outputs"):
        return None
    so = request.structured_outputs
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs needs one of json, regex, choice, grammar, json_object",
                                  param="structured_outputs")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    if kind == "json":
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}",
                                      param="structured_outputs.json") from None
    return StructuredOutputsParams(**{kind: value}, disable_any_whitespace=so.disable_any_whitespace)


class GenerationServicer(generation_service_pb2_grpc.GenerationServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _sequence(self, request: pb.GenerateRequest) -> SequenceState:
        if isinstance(request, UndecodableRequest):  # bytes protobuf could not parse (e.g. a string not UTF-8)
            raise request.error
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequestError("give either prompt or prompt_token_ids, not both", param="prompt")
        params = sampling_from_proto(
            request.sampling_params,
            max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=optional_field(request, "logprobs"),
            prompt_logprobs=optional_field(request, "prompt_logprobs"),
            structured_outputs=structured_from_proto(request),
        )
        if request.HasField("max_tokens") and request.max_tokens == 0:
            raise InvalidRequestError("max_tokens must be >= 1 (leave it unset for no limit)", param="max_tokens")
        penalties = request.sampling_params.penalties
        check_request_limits(max_n=self.gateway.config.max_n, stop=list(request.stop),  # the one table, as HTTP's
                             stop_token_ids=[*request.stop_token_ids, *penalties.stop_token_ids],
                             logit_bias=penalties.logit_bias)
        ids = list(request.prompt_token_ids) or self.gateway.tokenize(request.prompt)
        return self.gateway.new_sequence(ids, params, request.request_id or None, priority=request.priority)

    @map_stream_errors
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        try:
            yield from self._generate(request, context)
        except Exception as exc:
            request_error(self.gateway.served_model_name, "grpc", status_code_for(exc).name)
            raise

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        seq = self._sequence(request)
        k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        stream = self.gateway.stream(seq, k, deadline_from_timeout(time_remaining(context)),
                                     cancelled=lambda: not context.is_active())
        request_id = request.request_id or seq.sequence_id
        prompt_sent = False
        try:
            for delta in stream:  # a client that goes away stops it at the next round (cancelled)
                prompt_logprobs = None
                if seq.prompt_logprobs is not None and not prompt_sent:
                    prompt_logprobs, prompt_sent = logprobs_to_proto(seq.prompt_logprobs[1:]), True
                yield pb.GenerateResponse(
                    request_id=request_id,
                    text=delta.text,
                    token_ids=delta.token_ids,
                    finish_reason=_FINISH[seq.finish_reason if delta.finished else None],
                    stop_reason="" if seq.stop_reason is None else str(seq.stop_reason),
                    stats=_stats(seq),
                    prompt_tokens=len(seq.prompt_token_ids),
                    completion_tokens=len(seq.output_token_ids),
                    logprobs=logprobs_to_proto(delta.logprobs),
                    prompt_logprobs=prompt_logprobs,
                )
        finally:
            stream.close()

    @map_errors
    def GetInfo(self, request, context):
        g = self.gateway
        return pb.GetServingInfoResponse(
            target=g.target_info,
            draft=g.draft_info,
            num_speculative_tokens=g.config.num_speculative_tokens if g.draft else 0,
            draft_sample_method=g.config.draft_sample_method if g.draft else "",
        )


def add_servicer(servicer: GenerationServicer, server: grpc.Server) -> None:
    """``add_GenerationServiceServicer_to_server`` with a lenient request parser: a GenerateRequest that
    protobuf cannot parse (a string field that is not UTF-8 ...) is INVALID_ARGUMENT naming the field,
    where the generated code's failing deserializer would make gRPC answer INTERNAL."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=lenient_parser(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo, request_deserializer=common_pb2.GetInfoRequest.FromString,
            response_serializer=pb.GetServingInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def create_server(config: GatewayConfig, gateway: Gateway | None = None) -> ServerHandle:
    """Connect to the backends (waiting for them), check the pair, and serve GenerationService.

    With API keys, GenerationService (not health, not reflection) needs ``authorization: Bearer <key>``
    metadata, as /v1/* needs the header. TLS files are checked before the backends are contacted."""
    config = with_speculative_config(config)
    keys = ApiKeys.load(config.api_key, config.api_key_file)
    credentials = server_credentials_from(config)
    https = https_settings(config)
    gateway = gateway or Gateway(config)
    servicer = GenerationServicer(gateway)

    # One admission for both protocols (Gateway.admission: running + queued + refused, the same gauges and
    # counter): every call the admission may hold (running or queued) has a worker of its own, plus spares
    # for calls being refused, health checks and GetInfo, so no Generate waits unseen in the pool's queue.
    # Past that many calls in progress at once, gRPC refuses at once (RESOURCE_EXHAUSTED) rather than queue.
    workers = config.max_concurrent_requests + config.max_queue_len + SPARE_WORKERS

    def rejected(_method: str) -> None:
        request_error(gateway.served_model_name, "grpc", "UNAUTHENTICATED")

    try:
        handle = start_server(
            lambda server: add_servicer(servicer, server),
            [SERVICE_NAME], config.host, config.port, max_workers=workers, max_concurrent_rpcs=workers,
            max_receive_bytes=config.max_request_body_bytes, credentials=credentials,
            interceptors=[ApiKeyInterceptor(keys, on_reject=rejected)] if keys else [],
        )
    except BaseException:
        gateway.close()
        raise
    handle.backend = gateway
    handle.on_stop.append(gateway.close)
    handle.drain_grace = config.drain_grace_seconds  # SIGTERM: refuse new requests, finish those in flight
    handle.on_drain.append(gateway.drain)
    handle.in_flight = gateway.in_flight
    start_metrics_server(handle, config.metrics_port, config.host)
    if config.http_port is not None:
        from gateway.openai.api_server import HttpServer, create_app

        app = create_app(gateway, api_key=keys, served_model_name=config.served_model_name,
                         request_timeout=config.request_timeout_seconds)
        try:
            http = HttpServer(app, config.host, config.http_port, **https)
        except BaseException:  # e.g. the HTTP port is taken: stop what already started
            handle.stop(0)
            raise
        handle.http_port = http.port
        handle.on_stop.insert(0, http.stop)
    handle.set_serving(True)
    return handle
