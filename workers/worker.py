"""One tensor-parallel rank: its weight shard, its KV pool shard and the model runner.

A plain class, so it runs in-process (TP=1 offline) or inside a Ray actor (cluster/); either
way the scheduler reaches it only through `SchedulerOutput` and gets `ModelRunnerOutput` back.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
from pathlib import Path

import torch

from pagedray.attention.backend import select_backend
from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.workers.cpu_runtime import kv_pool_zeros, tune_malloc
from pagedray.workers.cpu_threads import (
    RESERVE_PROBE_ROWS,
    break_even_work_s,
    reserved_core_pays,
    step_runs_on_every_core,
)
from pagedray.workers.host_kv_buffer import HostKVBuffer, open_tier
from pagedray.workers.layers import cpu_ops, gemm
from pagedray.workers.layers.gemm import pack_module_weights, projection_work, warm_up
from pagedray.workers.lora import WorkerLoRA
from pagedray.workers.model_config import ModelConfig
from pagedray.workers.model_runner import ModelRunner
from pagedray.workers.models.llama import LlamaForCausalLM
from pagedray.workers.parallel_state import TensorParallelGroup, init_tensor_parallel
from pagedray.workers.sampler import Sampler
from pagedray.workers.weight_loader import load_weights
from pagedray.workers.worker_config import DEFAULT_CPU_KV_CACHE_BYTES, WorkerConfig

try:
    PAGEDRAY_VERSION = importlib.metadata.version("pagedray")
except importlib.metadata.PackageNotFoundError:  # run from a source tree not installed
    PAGEDRAY_VERSION = "source"

# oneDNN primitives compiled at start, for decode batch sizes from 1 up: at most this many rows
# and this long (128 x 5 projection shapes take about 0.3 s for the default model; a larger
# model gets fewer sizes). The rest compile on first use.
WARM_UP_ROWS = 128
WARM_UP_BUDGET_S = 0.5


logger = logging.getLogger(__name__)


class Worker:
    """Loads a shard, sizes and allocates the KV pool, and executes steps."""

    def __init__(self, config: WorkerConfig, rank: int = 0, init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # Torch threads for a step while a request streams (or for every step, without
        # `quiet_num_threads`): as set, else as torch has them on the building thread.
        self.serving_num_threads = config.num_threads or torch.get_num_threads()
        # Whether streamed decode steps keep to the serving count: judged as the pool is made.
        self.keeps_reserve = True
        self.device = _pick_device(config.device, rank)
        if self.device.type == "cpu":
            tune_malloc()
        self.model_config = ModelConfig.from_pretrained(config.model, config.dtype)
        if config.tensor_parallel_size > 1:
            assert init_method is not None, "tensor parallelism needs a rendezvous address"
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.tp = init_tensor_parallel(rank, config.tensor_parallel_size, init_method, backend)
        else:
            self.tp = TensorParallelGroup(rank=0, world_size=1, group=None)
        self.attention = select_backend(self.device)
        torch.manual_seed(config.seed)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.model_config, self.tp, self.attention)
        self.model.to(dtype=self.model_config.dtype)
        load_weights(self.model, config.model)
        self.model.eval()
        # Before packing: the adapters' stacks take their shapes from the plain weights.
        self.lora = (
            WorkerLoRA(self.model, self.model_config, config.max_loras, config.max_lora_rank)
            if config.enable_lora
            else None
        )
        if self.device.type == "cpu":
            pack_module_weights(self.model)
        self.runner: ModelRunner | None = None

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank, over all layers, K and V."""
        elem = torch.tensor([], dtype=self.model_config.dtype).element_size()
        return math.prod(self.model.kv_cache_shape(1, self.config.block_size)) * elem

    def determine_num_kv_blocks(self) -> int:
        """How many blocks fit this rank's budget; the cluster takes the minimum over ranks."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory_gb is not None:
            budget = int(cfg.kv_cache_memory_gb * 1024**3)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        else:
            blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
            enough = cfg.max_num_seqs * blocks_per_seq * self.kv_block_bytes()
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, enough)
        num_blocks = budget // self.kv_block_bytes()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gb: no KV block fits ({self.kv_block_bytes()} bytes per block)"
            )
        return int(num_blocks)

    def init_kv_cache(self, num_blocks: int) -> dict[str, str]:
        """Allocate the pool and open the node's KV tiers; returns their files' paths by name
        ("host", "disk"; none: no tier), which the scheduler opens too."""
        mc = self.model_config
        shape = self.model.kv_cache_shape(num_blocks, self.config.block_size)
        # NOTE: zeros, not empty: padded attention reads unused slots with zero weight, and
        # 0 * NaN from uninitialised memory would poison the output.
        if self.device.type == "cpu":
            kv_cache = kv_pool_zeros(shape, mc.dtype)
        else:
            kv_cache = torch.zeros(shape, dtype=mc.dtype, device=self.device)
        sampler = None
        if self.rank == 0:
            # On the logits' device: a draw takes its generator's device (a CPU generator
            # cannot draw for CUDA logits).
            generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
            sampler = Sampler(mc.eos_token_id, generator)
        if self.device.type == "cpu":
            # Decode steps run at batch sizes up to max_num_seqs: compile the small ones first,
            # at each thread count a step may run on (oneDNN compiles a primitive for each),
            # ending on the serving count.
            rows = min(self.config.max_num_seqs, WARM_UP_ROWS)
            for every_core in (True, False) if self._switches_threads() else (False,):
                self._use_threads(every_core)
                warm_up(self.model, rows, WARM_UP_BUDGET_S)
            if self._switches_threads() or self.tp.world_size > 1:
                self.keeps_reserve = self._reserve_pays()
        tiers = self._open_tiers(kv_cache)
        self.runner = ModelRunner(
            self.model,
            kv_cache,
            self.attention,
            sampler,
            self.config.max_num_seqs,
            self.config.max_model_len,
            self.device,
            host_tier=tiers["host"][1] if "host" in tiers else None,
            disk_tier=tiers["disk"][1] if "disk" in tiers else None,
            lora=self.lora,
        )
        return {name: path for name, (path, _) in tiers.items()}

    def arithmetic(self) -> str:
        """What decides the bits of the K/V blocks this worker computes (see AttentionBackend):
        the attention backend's kernels and setting, the projections' and the element-wise
        ops' paths, pagedray's version. Engines that differ in it share no blocks."""
        return (
            f"{self.attention.arithmetic()}; gemm {gemm.setting()}; "
            f"layer ops {cpu_ops.setting()}; pagedray {PAGEDRAY_VERSION}"
        )

    def _open_tiers(self, kv_cache: torch.Tensor) -> dict[str, tuple[str, HostKVBuffer]]:
        """The node's host KV tier and the disk tier below it, as configured and as they open."""
        cfg, tiers = self.config, {}
        if cfg.kv_offloading_size == 0:
            return {}
        arithmetic = self.arithmetic()
        args = (cfg.model, cfg.kv_offloading_size, self.rank, cfg.tensor_parallel_size, kv_cache)
        host = open_tier(*args, arithmetic)
        if host is None:
            return {}
        tiers["host"] = host
        if cfg.kv_disk_dir:
            disk_args = (cfg.model, cfg.kv_disk_gb, self.rank, cfg.tensor_parallel_size, kv_cache)
            disk = open_tier(*disk_args, arithmetic, directory=Path(cfg.kv_disk_dir), name="disk")
            if disk is not None:
                tiers["disk"] = disk
        return tiers

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "init_kv_cache must run before the first step"
        every_core = not self.keeps_reserve or step_runs_on_every_core(
            scheduler_output.streaming,
            scheduler_output.total_num_scheduled_tokens,
            len(scheduler_output.num_scheduled_tokens),
        )
        self._use_threads(every_core)
        return self.runner.execute_model(scheduler_output)

    def _reserve_pays(self) -> bool:
        """Measures the projections' work at a decode batch on one thread (`reserved_core_pays`);
        runs on, and leaves, the serving count. Collective at TP > 1: every CPU rank calls it
        (switching thread counts or not, which each judges from its own), and every rank gets
        the same answer: from the ranks' mean work, as a rank stepping on fewer threads than
        the others would hold up each all-reduce of every step; the default (True) unless every
        rank switches."""
        switches = self._switches_threads()
        rows = min(self.config.max_num_seqs, RESERVE_PROBE_ROWS)
        all_threads = self.config.quiet_num_threads or self.serving_num_threads
        # Past 4x the break-even, more passes could not change the answer.
        clear_s = 4 * break_even_work_s(rows, self.serving_num_threads, all_threads)
        own_s = projection_work(self.model, rows, enough_s=clear_s) if switches else 0.0
        summed = self.tp.all_reduce(torch.tensor([own_s, float(switches)], dtype=torch.float64))
        if int(summed[1].item()) < self.tp.world_size:
            return True
        work_s = float(summed[0].item()) / self.tp.world_size
        pays = reserved_core_pays(work_s, rows, self.serving_num_threads, all_threads)
        logger.info(
            "rank %d: projections at %d rows, %.1f ms of work (%.1f the ranks' mean): streamed "
            "steps run on %s", self.rank, rows, 1000 * own_s, 1000 * work_s,
            f"{self.serving_num_threads} thread(s)" if pays else f"every core ({all_threads})",
        )  # fmt: skip
        return pays

    def _switches_threads(self) -> bool:
        """Whether steps run on two thread counts: a CPU rank whose quiet count differs."""
        quiet = self.config.quiet_num_threads
        return self.device.type == "cpu" and quiet not in (None, self.serving_num_threads)

    def _use_threads(self, every_core: bool) -> None:
        """`quiet_num_threads` torch threads for a step that runs on every core, the serving
        count for any other (`step_runs_on_every_core`); nothing where they do not differ. Call
        it on the thread that steps: OpenMP keeps the count per thread, so it is read there."""
        if not self._switches_threads():
            return
        wanted = self.config.quiet_num_threads if every_core else self.serving_num_threads
        if wanted is not None and wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)


def resolved_device(device: str) -> str:
    """The device a rank of this process's node runs on for the `device` setting."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _pick_device(device: str, rank: int) -> torch.device:
    device = resolved_device(device)
    if device == "cuda":
        # NOTE: under Ray each actor sees only its own GPU as device 0.
        return torch.device("cuda", 0 if torch.cuda.device_count() == 1 else rank)
    return torch.device(device)
