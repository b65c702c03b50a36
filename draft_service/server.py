"""DraftService servicer: protobuf ↔ engine calls, nothing more."""

from __future__ import annotations

import grpc

from draft_service.config import DraftServiceConfig
from specdec.batching import ComputeThread
from specdec.backend import Backend
from specdec.config import TLI_PROPOSALS
from specdec.engine import ProposeCall
from specdec.errors import ConfigError
from specdec.grpc_utils import (
    BackendServicerMixin,
    ServerHandle,
    map_errors,
    probs_to_proto,
    require_ready,
    sampling_from_proto,
    start_backend_server,
    time_remaining,
)
from specdec.v1 import draft_service_pb2, draft_service_pb2_grpc

SERVICE_NAME = draft_service_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
_METHODS = {
    draft_service_pb2.DRAFT_SAMPLE_METHOD_UNSPECIFIED: None,
    draft_service_pb2.DRAFT_SAMPLE_METHOD_GREEDY: "greedy",
    draft_service_pb2.DRAFT_SAMPLE_METHOD_PROBABILISTIC: "probabilistic",
}


class DraftServicer(BackendServicerMixin, draft_service_pb2_grpc.DraftServiceServicer):
    def __init__(self, backend: Backend):
        self.backend = backend

    @map_errors
    def Propose(self, request: draft_service_pb2.ProposeRequest, context: grpc.ServicerContext):
        require_ready(self.backend)
        tokens = self.backend.history(request.sequence_id, request.start_position, list(request.new_token_ids))
        call = ProposeCall(
            sequence_id=request.sequence_id,
            token_ids=tokens,
            num_speculative_tokens=request.num_speculative_tokens,
            params=sampling_from_proto(request.sampling_params),
            draft_sample_method=_METHODS.get(request.draft_sample_method),
        )
        proposal = self.backend.propose(call, timeout=time_remaining(context))
        return draft_service_pb2.ProposeResponse(
            draft_token_ids=proposal.draft_token_ids,
            draft_probs=probs_to_proto(proposal.draft_probs),
            sequence_length=len(tokens),
        )


def create_server(config: DraftServiceConfig, load_async: bool = False,
                  compute: ComputeThread | None = None) -> ServerHandle:
    """Start a draft service on config.host:config.port (port 0 binds any free port).

    ``compute``: run its forward passes on this thread, shared with another model in the process.
    """
    if config.tli_proposals not in TLI_PROPOSALS:
        raise ConfigError(f"--tli-proposals must be one of {list(TLI_PROPOSALS)}, got {config.tli_proposals!r}")
    backend = Backend("draft", config, draft_sample_method=config.draft_sample_method,
                      draft_top_n=config.draft_top_n or None, target_tokenizer=config.target_tokenizer, compute=compute,
                      tli_proposals=config.tli_proposals)
    servicer = DraftServicer(backend)
    return start_backend_server(
        backend,
        lambda server: draft_service_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        config.host,
        config.port,
        load_async=load_async,
    )


def create_server_async(config) -> ServerHandle:
    """As create_server, but the port opens at once (NOT_SERVING) while the model loads."""
    return create_server(config, load_async=True)
