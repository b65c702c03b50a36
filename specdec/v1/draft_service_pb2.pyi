from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSampleMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SAMPLE_METHOD_UNSPECIFIED: _ClassVar[DraftSampleMethod]
    DRAFT_SAMPLE_METHOD_GREEDY: _ClassVar[DraftSampleMethod]
    DRAFT_SAMPLE_METHOD_PROBABILISTIC: _ClassVar[DraftSampleMethod]
DRAFT_SAMPLE_METHOD_UNSPECIFIED: DraftSampleMethod
DRAFT_SAMPLE_METHOD_GREEDY: DraftSampleMethod
DRAFT_SAMPLE_METHOD_PROBABILISTIC: DraftSampleMethod

class ProposeRequest(_message.Message):
    __slots__ = ("sequence_id", "start_position", "new_token_ids", "num_speculative_tokens", "sampling_params", "draft_sample_method", "features")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SAMPLE_METHOD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    start_position: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    sampling_params: _common_pb2.SamplingParams
    draft_sample_method: DraftSampleMethod
    features: _containers.RepeatedCompositeFieldContainer[_common_pb2.HiddenStates]
    def __init__(self, sequence_id: _Optional[str] = ..., start_position: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft_sample_method: _Optional[_Union[DraftSampleMethod, str]] = ..., features: _Optional[_Iterable[_Union[_common_pb2.HiddenStates, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_probs", "sequence_length", "features_from", "draft_parents")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenDistribution]
    sequence_length: int
    features_from: int
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_common_pb2.TokenDistribution, _Mapping]]] = ..., sequence_length: _Optional[int] = ..., features_from: _Optional[int] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...
