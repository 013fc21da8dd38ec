"""A decoder layer's element-wise work in one C call each on the CPU: add + RMSNorm, rotary
embedding with the K/V store, SiLU(gate) * up (attention/csrc/layer_ops_cpu.c).

Why: in a decode step of a few sequences these are 5-10 small torch ops each, and every torch op
costs 1-3 us of dispatch before any arithmetic: about 150 us a layer, more than the layer's
matmuls at batch 1 (a decode step at batch 1: 0.95 -> 0.74 ms of forward pass). The C versions
round where torch rounds (see the C file): bit-exact in bf16 for the rotation and the K/V
store, at most one bf16 step apart for the norm and SiLU, within rounding in float32
(tests/workers/test_cpu_ops.py).

They serve CPU tensors of float32 or bfloat16 whose rows are contiguous; anything else (a GPU,
float16, a 3-D view, no C compiler) takes the torch code. PAGEDRAY_CPU_LAYER_OPS=torch turns them
off, to compare or to rule them out.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from pagedray.attention import cpu_kernels
from pagedray.attention.cpu_kernels import CFunction

_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "rms_norm": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "silu_mul": [_PTR, _PTR, _I64, _I64],
    "rope_store": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR],
}


def serves(x: torch.Tensor) -> bool:
    """Whether `x` (2-D, last dim contiguous) can go through the C ops here."""
    return x.device.type == "cpu" and x.dtype in _entries() and x.dim() == 2 and x.stride(-1) == 1


def rms_norm(
    x: torch.Tensor,  # [rows, hidden], last dim contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * weight, x + residual), or (norm(x) * weight, None)."""
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=x.dtype)
    residual_out = None
    if residual is not None:
        residual = residual.contiguous()
        residual_out = torch.empty((rows, hidden), dtype=x.dtype)
    weight = weight.contiguous()
    _entries()[x.dtype]["rms_norm"](
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if residual_out is None else residual_out.data_ptr(),
        rows,
        hidden,
        eps,
    )
    return out, residual_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """SiLU of the first half of each row times its second half."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _entries()[gate_up.dtype]["silu_mul"](gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_and_store(
    qkv: torch.Tensor,  # [tokens, (num_heads + 2 * num_kv_heads) * head_dim], rotated in place
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,  # [tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim // 2] float32
    sin_cache: torch.Tensor,  # same
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # same
    slot_mapping: torch.Tensor,  # [tokens] int64, -1 = padding
) -> torch.Tensor:  # q: [tokens, num_heads, head_dim], a view of qkv
    """Rotate q in place and write rotated k and v into their cache slots, in one pass."""
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous float32 table")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if key_cache.dtype != qkv.dtype or value_cache.dtype != qkv.dtype:
        raise ValueError(f"caches hold {key_cache.dtype}, activations are {qkv.dtype}")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv: {qkv.shape[1]} columns for {num_heads}+2x{num_kv_heads} heads")
    if key_cache.shape[-2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches hold {tuple(key_cache.shape[-2:])} heads x dims per slot")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    tokens = qkv.shape[0]
    status = _entries()[qkv.dtype]["rope_store"](
        qkv.data_ptr(),
        qkv.stride(0),
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        positions.data_ptr(),
        cos_cache.shape[0],
        cos_cache.data_ptr(),
        sin_cache.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_mapping.data_ptr(),
    )
    if status != 0:
        raise ValueError(f"a position is outside the rotary tables ({cos_cache.shape[0]} rows)")
    return qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)


def setting() -> str:
    """PAGEDRAY_CPU_LAYER_OPS: c (the default) or torch."""
    return os.environ.get("PAGEDRAY_CPU_LAYER_OPS", "c")


@functools.cache
def _entries() -> dict[torch.dtype, dict[str, CFunction]]:
    if setting() == "torch" or not cpu_kernels.available():
        return {}
    lib = cpu_kernels.library()
    entries: dict[torch.dtype, dict[str, CFunction]] = {}
    for dtype, suffix in _SUFFIXES.items():
        entries[dtype] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name == "rope_store" else None
            entries[dtype][name] = fn
    return entries
