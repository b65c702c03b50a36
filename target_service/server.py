"""TargetService servicer: protobuf ↔ the target backend's calls, nothing more."""

from __future__ import annotations

import grpc

from specdec import token_mask
from specdec.errors import ConfigError
from specdec.proposal import Proposal
from specdec.seeding import SEEDED_SAMPLING
from specdec.serving.backend import Backend
from specdec.serving.backend_service import BackendServicerMixin, require_ready, start_backend_service
from specdec.serving.batching import ComputeThread
from specdec.serving.grpc_errors import map_errors
from specdec.serving.server import ServerHandle, batch_hint_of, time_remaining
from specdec.serving.wire import (feature_dtype_from_proto, features_to_proto, logprobs_to_proto, optional_field,
                                  probs_from_proto, sampling_from_proto)
from specdec.v1 import target_service_pb2, target_service_pb2_grpc

from specdec.calls import VerifyCall
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
        params = sampling_from_proto(request.sampling_params, logprobs=optional_field(request, "logprobs"),
                                     prompt_logprobs=optional_field(request, "prompt_logprobs"))
        mask = token_mask.from_bytes(request.token_bitmask, len(draft) + 1, self.backend.lm.vocab_size)
        parents = list(request.draft_parents) or None  # a token tree's (specdec.trees); empty: a chain
        call = VerifyCall(request.sequence_id, tokens, Proposal(draft, probs, mask, parents=parents), params,
                          feature_layers=tuple(request.feature_layers), feature_start=request.feature_start)
        if call.feature_layers:
            self.backend.check_feature_layers(call.feature_layers)
            feature_dtype = feature_dtype_from_proto(request.feature_dtype)
        result = self.backend.verify(call, timeout=time_remaining(context), hint=batch_hint_of(context))
        response = target_service_pb2.VerifyResponse(
            num_accepted_tokens=result.num_accepted_tokens,
            sequence_length=len(tokens) + result.num_accepted_tokens,
            logprobs=logprobs_to_proto(result.logprobs),
            prompt_logprobs=logprobs_to_proto(result.prompt_logprobs),
        )
        if result.features is not None:
            response.features.CopyFrom(features_to_proto(result.features, feature_dtype))
        path = result.accepted_path
        if path is not None and call.proposal.is_tree:
            response.accepted_path.extend(path)
            bonus = bool(path) and path[-1] not in parents  # the walk ended at a leaf
        else:
            bonus = result.num_accepted_tokens == len(draft)
        if bonus:
            response.bonus_token_id = result.next_token_id
        else:
            response.recovered_token_id = result.next_token_id
        return response


def create_server(config: TargetServiceConfig, load_async: bool = False,
                  compute: ComputeThread | None = None) -> ServerHandle:
    """Start a target service (see ``specdec.serving.backend_service.start_backend_service``)."""
    if config.seeded_sampling not in SEEDED_SAMPLING:  # before minutes of model loading
        raise ConfigError(f"--seeded-sampling must be one of {list(SEEDED_SAMPLING)}, got {config.seeded_sampling!r}")
    return start_backend_service(
        "target", config, TargetServicer, target_service_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME,
        load_async=load_async, compute=compute, seeded_sampling=config.seeded_sampling,
        tree_tile_rows=config.tree_tile_rows,
    )
