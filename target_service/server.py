"""TargetService servicer: protobuf ↔ engine calls, nothing more."""

from __future__ import annotations

import grpc

from specdec.batching import ComputeThread
from specdec.backend import Backend
from specdec.engine import Proposal, VerifyCall
from specdec.grpc_utils import (
    BackendServicerMixin,
    ServerHandle,
    map_errors,
    probs_from_proto,
    require_ready,
    sampling_from_proto,
    start_backend_server,
    time_remaining,
)
from specdec.v1 import target_service_pb2, target_service_pb2_grpc
from target_service.config import TargetServiceConfig

SERVICE_NAME = target_service_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(BackendServicerMixin, target_service_pb2_grpc.TargetServiceServicer):
    def __init__(self, backend: Backend):
        self.backend = backend

    @map_errors
    def Verify(self, request: target_service_pb2.VerifyRequest, context: grpc.ServicerContext):
        require_ready(self.backend)
        tokens = self.backend.history(request.sequence_id, request.start_position, list(request.new_token_ids))
        draft = list(request.draft_token_ids)
        probs = probs_from_proto(request.draft_probs, len(draft), self.backend.lm.vocab_size)
        call = VerifyCall(request.sequence_id, tokens, Proposal(draft, probs), sampling_from_proto(request.sampling_params))
        result = self.backend.verify(call, timeout=time_remaining(context))
        response = target_service_pb2.VerifyResponse(
            num_accepted_tokens=result.num_accepted_tokens,
            sequence_length=len(tokens) + result.num_accepted_tokens,
        )
        if result.num_accepted_tokens == len(draft):
            response.bonus_token_id = result.next_token_id
        else:
            response.recovered_token_id = result.next_token_id
        return response


def create_server(config: TargetServiceConfig, load_async: bool = False,
                  compute: ComputeThread | None = None) -> ServerHandle:
    """Start a target service on config.host:config.port (port 0 binds any free port).

    ``compute``: run its forward passes on this thread, shared with another model in the process.
    """
    backend = Backend("target", config, compute=compute)
    servicer = TargetServicer(backend)
    return start_backend_server(
        backend,
        lambda server: target_service_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        config.host,
        config.port,
        load_async=load_async,
    )


def create_server_async(config) -> ServerHandle:
    """As create_server, but the port opens at once (NOT_SERVING) while the model loads."""
    return create_server(config, load_async=True)
