"""The target's features as tensors and as the wire's bytes (torch; ``specdec.features`` holds the torch-free types)."""

from __future__ import annotations

import torch

from specdec.errors import InvalidRequestError
from specdec.features import FeatureChunk

WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def chunk_rows(chunk: FeatureChunk) -> torch.Tensor:
    """A chunk's features as a tensor [rows, width] (decoding the wire's bytes)."""
    if isinstance(chunk.data, torch.Tensor):
        return chunk.data
    dtype = WIRE_DTYPES.get(chunk.dtype)
    if dtype is None:
        raise InvalidRequestError(f"features dtype {chunk.dtype!r} is not one of {sorted(WIRE_DTYPES)}",
                                  param="features")
    data = bytes(chunk.data)
    need = chunk.rows * chunk.width * torch.finfo(dtype).bits // 8
    if len(data) != need:
        raise InvalidRequestError(f"features of {chunk.rows} x {chunk.width} {chunk.dtype} need {need} bytes, got "
                                  f"{len(data)}", param="features")
    return torch.frombuffer(bytearray(data), dtype=dtype).view(chunk.rows, chunk.width)


def encode_rows(rows: torch.Tensor, dtype: str) -> bytes:
    """A [rows, width] tensor's bytes in ``dtype`` (row-major, the machine's little-endian order)."""
    data = rows.detach().to(device="cpu", dtype=WIRE_DTYPES[dtype]).contiguous()
    return (data.view(torch.int16) if data.element_size() == 2 else data).numpy().tobytes()
