"""Which attention backend runs is decided in one place: the env variable, else the device."""

from __future__ import annotations

import pytest
import torch

from pagedray.attention import cpu_kernels
from pagedray.attention.backend import ENV_VAR, TORCH_BACKEND, select_backend


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_env_var_forces_torch(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    monkeypatch.setenv(ENV_VAR, "torch")
    assert select_backend(torch.device(device)) is TORCH_BACKEND


@pytest.mark.parametrize("value", ["triton", " Triton "])
def test_env_var_forces_triton(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    backend = select_backend(torch.device("cpu"))
    assert backend.name == "triton"
    # The Triton backend binds the three operations to its kernels, not to the reference.
    assert backend.paged_attention is not TORCH_BACKEND.paged_attention
    assert backend.store_kv is not TORCH_BACKEND.store_kv
    assert backend.copy_blocks is not TORCH_BACKEND.copy_blocks


def test_invalid_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=ENV_VAR):
        select_backend(torch.device("cpu"))


# The CPU default: the C kernels where they build (a C compiler is present), else the reference.
CPU_DEFAULT = "cpu" if cpu_kernels.available() else "torch"
needs_cpu_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no working C compiler: the CPU kernels cannot be built"
)


def test_default_follows_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert select_backend(torch.device("cpu")).name == CPU_DEFAULT
    assert select_backend(torch.device("cuda")).name == "triton"


def test_empty_value_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "")
    assert select_backend(torch.device("cpu")).name == CPU_DEFAULT


@needs_cpu_kernels
def test_env_var_forces_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cpu")
    backend = select_backend(torch.device("cpu"))
    assert backend.name == "cpu"
    assert backend.paged_attention is not TORCH_BACKEND.paged_attention
    with pytest.raises(ValueError, match="cannot run on cuda"):
        select_backend(torch.device("cuda"))
