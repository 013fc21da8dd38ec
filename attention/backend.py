"""One attention interface for the model; which implementation runs is chosen here, not there.

Triton kernels on CUDA; on CPU the C decode kernel where it builds (cpu_backend.py), else the
plain-torch reference. `PAGEDRAY_ATTENTION_BACKEND=triton|cpu|torch` forces one.
"""

from __future__ import annotations

import os

import torch

from pagedray.attention import cpu_kernels, torch_ref
from pagedray.attention.interface import AttentionBackend
from pagedray.attention.metadata import AttentionMetadata

ENV_VAR = "PAGEDRAY_ATTENTION_BACKEND"

TORCH_BACKEND = AttentionBackend(
    name="torch",
    store_kv=torch_ref.store_kv,
    paged_attention=torch_ref.paged_attention,
    copy_blocks=torch_ref.copy_blocks,
    arithmetic=lambda: f"torch reference, torch {torch.__version__}",
)


def select_backend(device: torch.device) -> AttentionBackend:
    """The backend for `device`, unless the environment variable names one."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice not in ("", "torch", "cpu", "triton"):
        raise ValueError(f"{ENV_VAR}: must be 'triton', 'cpu' or 'torch', got {choice!r}")
    if not choice:
        if device.type == "cuda":
            choice = "triton"
        else:
            choice = "cpu" if device.type == "cpu" and cpu_kernels.available() else "torch"
    if choice == "torch":
        return TORCH_BACKEND
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(f"{ENV_VAR}=cpu: the CPU kernels cannot run on {device}")
        if not cpu_kernels.available():
            raise ValueError(f"{ENV_VAR}=cpu: the CPU kernels did not build here (see the log)")
        return _cpu_backend()
    return _triton_backend()


def _cpu_backend() -> AttentionBackend:
    from pagedray.attention import cpu_backend

    return cpu_backend.CPU_BACKEND


def _triton_backend() -> AttentionBackend:
    from pagedray.attention import triton_backend

    return triton_backend.TRITON_BACKEND


__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend", "TORCH_BACKEND"]
