"""y = x W^T + b for every projection: oneDNN's matmul on the CPU, `F.linear` elsewhere.

On the CPU `F.linear` goes to MKL's sgemm for float32. Measured on this project's AMD Zen 5 CI
machine (2 threads, Llama-shaped projections, torch 2.13), oneDNN's fp32 matmul is 2.2x faster
at 64-2048 rows (about 500 against 225 GFLOP/s) and 1.7x at 1-4 rows, where MKL pays a fixed
cost per call that dominates decode steps; oneDNN also JIT-compiles for the exact instruction
set (AVX-512, AVX512-BF16), where MKL takes a generic path on non-Intel CPUs. It is the same
library torch already uses for bfloat16 linears and vLLM's CPU build for its GEMMs.

The result stays IEEE float32: oneDNN accumulates in fp32 in another order than MKL, so outputs
differ from `F.linear` by rounding only (checked against float64 in tests/workers).

`torch.ops.mkldnn._linear_pointwise` takes the plain weight or, faster at decode sizes, one laid
out once in oneDNN's blocked format (`pack`; `pack_module_weights` then releases the plain copy
unless another module shares it, as a tied embedding does). It is a private op, so it is probed
once and `F.linear` serves wherever it is missing or refuses (a CPU without oneDNN, a dtype
oneDNN has no fast kernel for here).
Set PAGEDRAY_CPU_GEMM=torch to force `F.linear` (to compare, or to rule oneDNN out).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import cast

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CACHE_CAPACITY_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
CACHE_CAPACITY = 4096


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out], in x's dtype.

    `packed`, when given, is `pack(weight)`: used in its place, and `weight` may then be empty.
    """
    if packed is not None and x.dim() == 2 and x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if packed is not None:
        weight = packed.to_dense()  # not a path the model takes: 3-D input, another dtype
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in _onednn_dtypes():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a [out, in] weight, laid out once for this CPU's kernels; None
    where oneDNN does not serve the weight's dtype or device.

    With the plain weight oneDNN re-lays it out on every call, which at decode sizes costs as
    much as the product (measured: 1-16 rows, 1.4-2.4x faster packed; 2,048 rows, the same).
    """
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _onednn_dtypes():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def pack_module_weights(model: torch.nn.Module) -> int:
    """Pack the weight of every module that takes one (a `packed_weight` attribute) and release
    the plain copy where no other module shares it (a tied embedding keeps its own). Returns how
    many were packed. Call once the weights are loaded: loading into a released weight fails."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        packed = pack(weight)
        if packed is None:
            continue
        module.packed_weight = packed
        if owners[id(weight)] == 1:
            weight.data = torch.empty(0, dtype=weight.dtype)
        count += 1
    return count


def setting() -> str:
    """PAGEDRAY_CPU_GEMM: onednn (the default) or torch."""
    return os.environ.get("PAGEDRAY_CPU_GEMM", "onednn")


@functools.cache
def _onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes oneDNN's matmul serves on this CPU, each checked once against `F.linear`."""
    if setting() == "torch":
        return frozenset()
    # oneDNN compiles a primitive per input shape and keeps 1,024: five projections of a layer
    # at every batch size up to 256 sequences already need more, and past its capacity the cache
    # thrashes (a sweep of 300 sizes: 0.97 s, 0.42 s with room). A primitive is also per thread
    # count, and a serving rank steps at two (workers/cpu_threads.py). Read when oneDNN first builds
    # a primitive, which the probe below does; a value the user set stays.
    os.environ.setdefault(CACHE_CAPACITY_ENV, str(CACHE_CAPACITY))
    has_op = hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if not (torch.backends.mkldnn.is_available() and has_op):
        return frozenset()
    wanted = [torch.float32]
    # Without AVX512-BF16 (or AMX) oneDNN emulates bf16 slowly; F.linear is then no worse.
    if _has_native_bf16():
        wanted.append(torch.bfloat16)
    served = frozenset(dtype for dtype in wanted if _agrees_with_torch(dtype))
    logger.debug("CPU GEMM through oneDNN for %s", sorted(str(d) for d in served))
    return served


def _has_native_bf16() -> bool:
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _agrees_with_torch(dtype: torch.dtype) -> bool:
    """A small product through oneDNN equals F.linear's up to rounding: else we do not use it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=generator).to(dtype)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    except (RuntimeError, NotImplementedError) as error:
        logger.info("oneDNN linear unavailable for %s, using F.linear: %s", dtype, error)
        return False
    want = F.linear(x.double(), weight.double(), bias.double())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return got.shape == want.shape and bool(torch.allclose(got.double(), want, atol=tolerance * 40))


def _projections(
    model: torch.nn.Module,
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """(weight, bias, packed weight or None) of each projection of `model`: every module with a
    `packed_weight` attribute, packed or not (`weight` may be empty once packed)."""
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            yield (
                cast(torch.Tensor, module.weight),
                cast("torch.Tensor | None", getattr(module, "bias", None)),
                cast("torch.Tensor | None", module.packed_weight),
            )


def warm_up(model: torch.nn.Module, max_rows: int, budget_s: float) -> int:
    """Has oneDNN compile its primitive for each packed projection (weight shape, with or
    without bias) at 1, 2, ... max_rows input rows, smallest first, until `budget_s` is spent:
    so that a server's first decode steps do not pay it (about 0.4 ms a shape here; 0.2 s over
    a first pass of the benchmark workload). A large model's products take longer, so fewer
    row counts fit in the budget. Returns the number of products run."""
    projections = {}
    for _, bias, packed in _projections(model):
        if packed is not None:
            projections[(tuple(packed.shape), packed.dtype, bias is not None)] = (packed, bias)
    count, deadline = 0, time.perf_counter() + budget_s
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            for (shape, dtype, _), (packed, bias) in projections.items():
                if time.perf_counter() > deadline:
                    return count
                linear(torch.zeros(rows, shape[1], dtype=dtype), torch.empty(0), bias, packed)
                count += 1
    return count


def projection_work(
    model: torch.nn.Module, rows: int, repeats: int = 3, enough_s: float = math.inf
) -> float:
    """CPU seconds one pass over every projection of `model` (each module with a
    `packed_weight` attribute, packed or not) takes at `rows` input rows on one torch thread:
    the work of most of a decode step of `rows` sequences, which other processes' load changes
    far less than it changes wall time. Run on one thread (the caller's count is restored), so
    the calling thread's CPU time is all of it. The least of up to `repeats` passes, stopping
    once one took over `enough_s` (the answer is clear; a large model's pass takes seconds),
    after an untimed pass that has oneDNN compile what it needs; no tensor-parallel reduction
    runs."""
    products: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    products = []
    inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for plain, bias, packed in _projections(model):
        # The packed weight's shape and dtype: the plain one may have been released.
        weight = plain if packed is None else packed
        key = (int(weight.shape[-1]), weight.dtype)
        x = inputs.setdefault(key, torch.zeros(rows, key[0], dtype=key[1]))
        products.append((x, plain, bias, packed))

    def one_pass() -> float:
        start = time.thread_time()
        for x, weight, bias, packed in products:
            linear(x, weight, bias, packed)
        return time.thread_time() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            one_pass()
            least = math.inf
            for _ in range(repeats):
                least = min(least, one_pass())
                if least > enough_s:
                    break
            return least
    finally:
        torch.set_num_threads(threads)
