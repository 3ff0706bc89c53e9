"""What travels between the grader and a rank: JSON and raw tensor bytes, never a pickle.

A rank runs the submission's code, so whatever it sends back is untrusted: unpickling it would
run any code it likes in the process that decides the grade. A message here is a JSON header
(plain values; each tensor replaced by its dtype, shape and byte count) followed by the tensors'
bytes, and decoding it builds nothing but dicts, lists, numbers, strings and fresh tensors. The
same format carries a test's data to the ranks, so no tensor shares memory with the grader.
"""

from __future__ import annotations

import json
import math
import struct

import torch

MAX_MESSAGE_BYTES = 256 << 20
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}
_HEADER = struct.Struct("<Q")
_TENSOR = "__tensor__"


class WireError(ValueError):
    """A message that is not one this module wrote: the rank's report is unusable."""


def encode(value: object) -> bytes:
    blobs: list[bytes] = []

    def plain(v: object) -> object:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                t, dtype = t.float(), "float32"
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            blobs.append(data)
            return {_TENSOR: dtype, "shape": list(t.shape), "bytes": len(data)}
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"cannot send a {type(v).__name__}")

    header = json.dumps(plain(value), allow_nan=True).encode()
    return _HEADER.pack(len(header)) + header + b"".join(blobs)


def decode(data: bytes) -> object:
    """The value ``encode`` wrote; WireError for anything else (a truncated or forged message)."""
    if len(data) > MAX_MESSAGE_BYTES or len(data) < _HEADER.size:
        raise WireError(f"a message of {len(data)} bytes")
    (length,) = _HEADER.unpack_from(data)
    if length > len(data) - _HEADER.size:
        raise WireError("the header runs past the message")
    try:
        header = json.loads(data[_HEADER.size:_HEADER.size + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"an unreadable header: {e}") from e
    offset = _HEADER.size + length

    def build(v: object) -> object:
        nonlocal offset
        if isinstance(v, dict) and _TENSOR in v:
            dtype, shape, size = DTYPES.get(v.get(_TENSOR)), v.get("shape"), v.get("bytes")
            if dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
                raise WireError(f"a tensor described as {str(v)[:80]}")
            expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if size != expected or offset + size > len(data):
                raise WireError(f"a tensor of shape {shape} with {size} bytes")
            raw = bytearray(data[offset:offset + size])
            offset += size
            if not size:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=dtype).reshape(shape)
        if isinstance(v, dict):
            return {k: build(x) for k, x in v.items()}
        if isinstance(v, list):
            return [build(x) for x in v]
        return v

    value = build(header)
    if offset != len(data):
        raise WireError(f"{len(data) - offset} bytes after the last tensor")
    return value
