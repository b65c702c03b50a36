"""Protobuf ↔ the library's types (no grpc, no torch here): sampling parameters, q rows, model info."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from specdec.errors import InvalidRequestError
from specdec.features import FeatureChunk
from specdec.proposal import TokenLogprob
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams, **extra) -> SamplingParams:
    seed = msg.seed if msg.HasField("seed") else None
    if seed is not None and seed >= 2**63:
        raise InvalidRequestError("seed must be below 2**63", param="seed")
    penalties = {}
    if msg.HasField("penalties"):
        pen = msg.penalties
        penalties = dict(presence_penalty=float(pen.presence_penalty), frequency_penalty=float(pen.frequency_penalty),
                         repetition_penalty=float(pen.repetition_penalty) if pen.repetition_penalty > 0 else 1.0,
                         logit_bias={int(t): float(v) for t, v in pen.logit_bias.items()} or None,
                         min_tokens=int(pen.min_tokens), stop_token_ids=list(pen.stop_token_ids),
                         ignore_eos=bool(pen.ignore_eos), num_prompt_tokens=optional_field(pen, "num_prompt_tokens"),
                         allowed_token_ids=list(pen.allowed_token_ids) or None)
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=int(msg.top_k),
        min_p=float(msg.min_p),
        seed=seed,
        priority=int(msg.priority),
        **{"max_tokens": None, **penalties, **extra},  # the services never count max_tokens: the gateway does
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    min_p=params.min_p, priority=params.priority)
    if params.seed is not None:
        msg.seed = params.seed
    if params.has_penalties:
        msg.penalties.CopyFrom(common_pb2.Penalties(
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias or {},
            min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
            num_prompt_tokens=params.num_prompt_tokens,  # None: unset
            allowed_token_ids=params.allowed_token_ids or []))
    return msg


def probs_to_proto(probs) -> list[common_pb2.TokenDistribution]:
    """[k, vocab] q → one TokenDistribution per row, sparse when that is smaller."""
    from specdec import sparse_probs  # torch: imported where tensors are met (a gateway relays rows as they came)

    return [common_pb2.TokenDistribution(token_ids=ids, probs=values) for ids, values in sparse_probs.to_rows(probs)]


def probs_from_proto(rows: Iterable[common_pb2.TokenDistribution], k: int, vocab_size: int):
    """The rows back to a [k, vocab_size] tensor (None: no rows, one-hot drafts)."""
    from specdec import sparse_probs

    return sparse_probs.from_rows(((row.token_ids, row.probs) for row in rows), k, vocab_size)


_FEATURE_DTYPES = {common_pb2.FEATURE_DTYPE_BFLOAT16: "bfloat16", common_pb2.FEATURE_DTYPE_FLOAT16: "float16",
                   common_pb2.FEATURE_DTYPE_FLOAT32: "float32"}
DEFAULT_FEATURE_DTYPE = "bfloat16"  # features on the wire: half the bytes of fp32, the precision a head needs


def feature_dtype_from_proto(value: int) -> str:
    if value == common_pb2.FEATURE_DTYPE_UNSPECIFIED:
        return DEFAULT_FEATURE_DTYPE
    if value not in _FEATURE_DTYPES:
        raise InvalidRequestError(f"feature_dtype {value} is not one of {sorted(_FEATURE_DTYPES)}",
                                  param="feature_dtype")
    return _FEATURE_DTYPES[value]


def features_to_proto(chunk: FeatureChunk | None, dtype: str = DEFAULT_FEATURE_DTYPE) -> common_pb2.HiddenStates | None:
    """A target's features (a tensor chunk) as HiddenStates in ``dtype`` (None: none were computed)."""
    if chunk is None:
        return None
    if isinstance(chunk.data, (bytes, bytearray, memoryview)):  # relayed as it came
        return common_pb2.HiddenStates(start_position=chunk.start, num_positions=chunk.rows, width=chunk.width,
                                       dtype={v: k for k, v in _FEATURE_DTYPES.items()}.get(chunk.dtype, 0),
                                       data=bytes(chunk.data))
    from specdec.feature_rows import encode_rows  # torch: where tensors are met (a gateway relays bytes as they came)

    raw = encode_rows(chunk.data, dtype)
    code = {v: k for k, v in _FEATURE_DTYPES.items()}[dtype]
    return common_pb2.HiddenStates(start_position=chunk.start, num_positions=chunk.rows, width=chunk.width,
                                   dtype=code, data=raw)


def features_from_proto(msg: common_pb2.HiddenStates) -> FeatureChunk:
    """HiddenStates as a chunk holding the wire's bytes (the draft decodes them: ``eagle3_worker.chunk_rows``)."""
    return FeatureChunk(msg.start_position, msg.num_positions, msg.width, _FEATURE_DTYPES.get(msg.dtype, "?"),
                        msg.data)


def mask_to_bytes(bitmask) -> bytes:
    """A proposal's allowed-token rows ([rows, words] int32 tensor; None: none) as VerifyRequest.token_bitmask
    (``specdec.token_mask`` reads them back)."""
    return b"" if bitmask is None else bitmask.numpy().astype("<i4").tobytes()


def model_info_to_proto(info: dict) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(**info)


def logprobs_to_proto(logprobs: Iterable[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top]) for lp in logprobs or ()]


def logprobs_from_proto(rows: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(row.token_id, row.logprob, list(zip(row.top_token_ids, row.top_logprobs))) for row in rows]


def optional_field(msg, name: str) -> int | None:
    """A proto3 ``optional`` scalar: its value, or None when unset."""
    return getattr(msg, name) if msg.HasField(name) else None


# -- requests protobuf cannot parse ------------------------------------------------------------------


class UndecodableRequest:
    """What ``lenient_parser`` hands the servicer for bytes protobuf could not parse: the servicer raises
    ``error`` (INVALID_ARGUMENT), where a failing deserializer would make gRPC answer INTERNAL."""

    def __init__(self, error: InvalidRequestError):
        self.error = error


def lenient_parser(message_cls) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: a message, or an ``UndecodableRequest`` saying what to fix
    (the string field that is not UTF-8, e.g. a lone surrogate another client let through)."""
    name = message_cls.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            field = bad_utf8_field(message_cls.DESCRIPTOR, data)
            if field is not None:
                return UndecodableRequest(InvalidRequestError(
                    f"{field} is not valid UTF-8 (protobuf string fields hold UTF-8 text: no lone surrogates); "
                    "send it as UTF-8 text", param=field))
            return UndecodableRequest(InvalidRequestError(f"the request is not a valid {name} message ({exc})"))

    return parse


def bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The dotted name of the first string field of the serialized ``data`` that is not UTF-8 (None: none
    found, or the bytes are not protobuf's wire format at all)."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return prefix + field.name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = bad_utf8_field(field.message_type, chunk, f"{prefix}{field.name}.")
                    if found is not None:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
