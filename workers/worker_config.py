"""What one tensor-parallel rank needs to know to load its shard and size its KV pool."""

from __future__ import annotations

from dataclasses import dataclass

# On CPU there is no device memory to measure, so the KV pool gets at most this much.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class WorkerConfig:
    """Frozen; built by the cluster from the user's engine config."""

    model: str  # checkpoint directory (HF format)
    dtype: str = "auto"  # "auto" = the checkpoint's dtype
    tensor_parallel_size: int = 1
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256
    max_model_len: int = 2048
    num_kv_blocks: int | None = None  # fixed pool size; None = size it from memory
    kv_cache_memory_gb: float | None = None  # KV pool budget per rank; None = device default
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the rank may use
    seed: int = 0
    num_threads: int | None = None  # torch threads on CPU: the cores this rank owns
    # Torch threads on CPU for a step whose plan says no request streams (the cores the serving
    # path otherwise keeps; workers/cpu_threads.py); None: `num_threads` for every step.
    quiet_num_threads: int | None = None
    device: str = "auto"  # "auto" = cuda when available
    # GiB of the node's host KV tier (workers/host_kv_buffer.py); None: sized from free memory,
    # 0: no tier.
    kv_offloading_size: float | None = None
    kv_disk_dir: str | None = None  # the disk tier's directory, below the host's; None: none
    kv_disk_gb: float = 16.0  # its size
    # LoRA adapters: `max_loras` slots of adapters up to `max_lora_rank` (workers/lora.py).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
