"""pagedray: paged KV cache, prefix caching, copy-on-write sampling, continuous batching."""

from __future__ import annotations

from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
]


def __getattr__(name: str):
    # NOTE: lazy so `import pagedray` (e.g. for SamplingParams) does not import torch.
    if name == "LLM":
        from pagedray.llm import LLM

        return LLM
    if name == "LoRARequest":
        from pagedray.engine.lora_adapters import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedray.scheduler import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
