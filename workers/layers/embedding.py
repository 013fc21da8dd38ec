"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of tp size * VOCAB_PAD_MULTIPLE so every rank holds an
equal, contiguous slice of rows; padding rows are zero and their logits are trimmed away.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedray.workers.layers.gemm import linear
from pagedray.workers.parallel_state import TensorParallelGroup
from pagedray.workers.weight_loader import WeightSource, copy_weight, narrow_weight

VOCAB_PAD_MULTIPLE = 64  # per rank; keeps each rank's slice aligned for the matmul


def pad_vocab_size(vocab_size: int, world_size: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * world_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the tokens in its vocabulary slice; the all-reduce fills in the rest."""

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        tp: TensorParallelGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, tp.world_size)
        self.num_local_rows = self.padded_vocab_size // tp.world_size
        self.vocab_start = tp.rank * self.num_local_rows
        self.vocab_end = self.vocab_start + self.num_local_rows
        self.weight = nn.Parameter(
            torch.zeros(self.num_local_rows, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: object = None
    ) -> None:
        # Only the real rows of this slice come from disk; padding rows stay zero.
        num_real = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        param.data.zero_()
        if num_real > 0:
            rows = narrow_weight(loaded_weight, 0, self.vocab_start, num_real)
            copy_weight(param.data[:num_real], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, embedding_dim]
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_slice = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_tokens]
        local_ids = (input_ids - self.vocab_start) * in_slice  # out-of-slice ids read row 0
        embeddings = F.embedding(local_ids, self.weight)  # [num_tokens, embedding_dim]
        embeddings = embeddings * in_slice.unsqueeze(-1).to(embeddings.dtype)
        return self.tp.all_reduce(embeddings)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits column-parallel over the vocabulary; may share its weight with the embedding."""

    # Set by gemm.pack_module_weights once loaded: oneDNN's layout of `weight` on the CPU.
    packed_weight: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied with compute_logits(hidden_states)")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, vocab_size] on every rank."""
        local_logits = linear(hidden_states, self.weight, None, self.packed_weight)
        logits = self.tp.all_gather(local_logits, dim=-1)  # [num_tokens, padded_vocab_size]
        return logits[:, : self.vocab_size]
