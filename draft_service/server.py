"""DraftService servicer: protobuf ↔ the draft backend's calls, nothing more."""

from __future__ import annotations

import grpc

from draft_service.config import DraftServiceConfig
from specdec.config import DRAFT_KEYS, FEATURE_METHODS, NO_MODEL_NAMES, TLI_PROPOSALS, SpeculativeConfig
from specdec.errors import ConfigError
from specdec.ngram import lookup_indexes
from specdec.serving.backend import Backend
from specdec.serving.backend_service import BackendServicerMixin, require_ready, start_backend_service
from specdec.serving.batching import ComputeThread
from specdec.serving.grpc_errors import map_errors
from specdec.serving.server import ServerHandle, batch_hint_of, time_remaining
from specdec.serving.wire import features_from_proto, probs_to_proto, sampling_from_proto
from specdec.v1 import draft_service_pb2, draft_service_pb2_grpc
from specdec.calls import ProposeCall

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
            features=[features_from_proto(m) for m in request.features] or None,
        )
        proposal = self.backend.propose(call, timeout=time_remaining(context), hint=batch_hint_of(context))
        return draft_service_pb2.ProposeResponse(
            draft_token_ids=proposal.draft_token_ids,
            draft_probs=probs_to_proto(proposal.draft_probs),
            sequence_length=len(tokens),
            features_from=proposal.features_from,  # None: unset (not an EAGLE draft)
            draft_parents=proposal.parents if proposal.is_tree else (),
        )


def create_server(config: DraftServiceConfig, load_async: bool = False,
                  compute: ComputeThread | None = None) -> ServerHandle:
    """Start a draft service (see ``specdec.serving.backend_service.start_backend_service``)."""
    if config.tli_proposals not in TLI_PROPOSALS:
        raise ConfigError(f"--tli-proposals must be one of {list(TLI_PROPOSALS)}, got {config.tli_proposals!r}")
    # method ngram never loads a model; method suffix does unless --model names none (then it is hybrid)
    model = None if config.method == "ngram" or config.model in NO_MODEL_NAMES else config.model
    spec = SpeculativeConfig.from_any({"method": config.method, "model": model,
                                       "prompt_lookup_max": config.prompt_lookup_max,
                                       "prompt_lookup_min": config.prompt_lookup_min,
                                       **{key: getattr(config, key) for key in DRAFT_KEYS}})
    eagle_target = None
    if spec.method in FEATURE_METHODS:
        eagle_target = config.target_model or config.target_tokenizer
        if not eagle_target:
            raise ConfigError(f"--method {spec.method} drafts from a target's features with the target's embedding: "
                              "give the target's model with --target-model")
    model_k = config.draft_model_num_speculative_tokens
    if model_k is not None and (model is None or not spec.uses_lookup):
        raise ConfigError("--draft-model-num-speculative-tokens is the model's k in hybrid drafting: it needs a model "
                          "and a lookup method (--method suffix, or --prompt-lookup-max)")
    return start_backend_service(
        "draft", config, DraftServicer, draft_service_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME,
        load_async=load_async, compute=compute, draft_sample_method=config.draft_sample_method,
        draft_top_n=config.draft_top_n or None, target_tokenizer=config.target_tokenizer,
        tli_proposals=config.tli_proposals, lookup=lookup_indexes(spec),
        model_free=spec.method if spec.model_free else None, model_k=model_k, eagle_target=eagle_target,
        merge_score=spec.suffix_decoding_merge_score,
        tree_shape=spec.tree_shape(),  # (a TLI draft with text proposals drafts chains, and says so: DraftWorker)
    )
