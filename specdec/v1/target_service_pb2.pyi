from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("sequence_id", "start_position", "new_token_ids", "draft_token_ids", "draft_probs", "sampling_params", "logprobs", "prompt_logprobs", "token_bitmask", "feature_layers", "feature_start", "feature_dtype", "draft_parents")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    start_position: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    sampling_params: _common_pb2.SamplingParams
    logprobs: int
    prompt_logprobs: int
    token_bitmask: bytes
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    feature_start: int
    feature_dtype: _common_pb2.FeatureDType
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[str] = ..., start_position: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., token_bitmask: _Optional[bytes] = ..., feature_layers: _Optional[_Iterable[int]] = ..., feature_start: _Optional[int] = ..., feature_dtype: _Optional[_Union[_common_pb2.FeatureDType, str]] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted_tokens", "bonus_token_id", "recovered_token_id", "sequence_length", "logprobs", "prompt_logprobs", "features", "accepted_path")
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    num_accepted_tokens: int
    bonus_token_id: int
    recovered_token_id: int
    sequence_length: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    features: _common_pb2.HiddenStates
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_accepted_tokens: _Optional[int] = ..., bonus_token_id: _Optional[int] = ..., recovered_token_id: _Optional[int] = ..., sequence_length: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., accepted_path: _Optional[_Iterable[int]] = ...) -> None: ...
