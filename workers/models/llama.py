"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as one tensor-parallel, paged-KV model.

The variants differ only in flags read from ModelConfig: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), rope scaling (Llama 3.1), tied embeddings. Parameter names mirror HF's so the
weight loader only has to map the fused q/k/v and gate/up projections.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedray.attention.interface import AttentionBackend
from pagedray.attention.metadata import AttentionMetadata
from pagedray.workers.layers import cpu_ops
from pagedray.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedray.workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedray.workers.layers.norm import RMSNorm
from pagedray.workers.layers.rotary import RotaryEmbedding
from pagedray.workers.model_config import ModelConfig
from pagedray.workers.parallel_state import TensorParallelGroup


class LlamaAttention(nn.Module):
    """Fused qkv projection, (qk norm), rope, paged attention over the KV cache, output proj."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelGroup,
        attention: AttentionBackend,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.rotary_emb = rotary_emb
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            tp,
            bias=config.attention_bias,
            dtype=config.dtype,
        )
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # on this rank
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            tp,
            bias=config.o_proj_bias,
            dtype=config.dtype,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        q_size = self.qkv_proj.q_size
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.q_norm is None and self.attention.name == "cpu" and cpu_ops.serves(qkv):
            # One C pass: q rotated in place, rotated k and v written to their cache slots.
            cos_table, sin_table = self.rotary_emb.float32_tables()
            q = cpu_ops.rope_and_store(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                positions,
                cos_table,
                sin_table,
                key_cache,
                value_cache,
                metadata.slot_mapping,
            )
        else:
            q = self._rotate_and_store(qkv, positions, key_cache, value_cache, metadata)
        out = self.attention.paged_attention(q, key_cache, value_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, q_size))  # out: [num_tokens, heads, head_dim]

    def _rotate_and_store(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]
        positions: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # q: [num_tokens, heads, head_dim]
        """(q/k norm), rope, and k and v written to the cache, in torch and the backend."""
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [tokens, heads, head_dim]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [tokens, kv_heads, dim]
            # Qwen3 normalises each head over head_dim before rope.
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        else:
            # q and k heads sit side by side in qkv: rotate them in one pass.
            qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
            qk = self.rotary_emb.rotate(positions, qk)  # [tokens, heads + kv_heads, head_dim]
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        # Written before attending: this step's tokens attend to themselves through the cache.
        self.attention.store_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        return q


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel matmul."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], tp, bias=config.mlp_bias, dtype=config.dtype
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, tp, bias=config.mlp_bias, dtype=config.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate / tp]
        if cpu_ops.serves(gate_up):
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate / tp] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelGroup,
        attention: AttentionBackend,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp, attention, rotary_emb)
        self.mlp = LlamaMLP(config, tp)
        eps, dtype = config.rms_norm_eps, config.dtype
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None before the first layer
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of each sub-block is deferred into the next norm.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_and_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, metadata)
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup, attention: AttentionBackend
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp, config.dtype
        )
        # Shared by every layer: one cos/sin table for the whole model.
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, attention, rotary_emb)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None
        for layer_idx, layer in enumerate(self.layers):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache[layer_idx], metadata
            )
        if residual is None:  # a model with no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm.add_and_norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """One rank's shard of a Llama-family model, run over a ragged batch with a paged KV cache.

    Build it under `with torch.device(device):` so parameters and the rope table are created
    there, then call `load_weights(checkpoint_dir)`.
    """

    # HF checkpoint module -> (our fused module, shard id), consumed by the weight loader.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup, attention: AttentionBackend
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp, attention)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # KV heads this rank caches: num_key_value_heads / tp, or 1 when replicated.
        self.num_kv_heads_per_rank: int = config.num_key_value_heads
        if config.num_hidden_layers:
            first_layer = self.model.layers[0]
            assert isinstance(first_layer, LlamaDecoderLayer)
            self.num_kv_heads_per_rank = first_layer.self_attn.num_kv_heads

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Run one step's tokens, writing their K/V into `kv_cache` at `metadata.slot_mapping`.

        Returns the final-norm hidden states of every token; pass the rows to sample from to
        `compute_logits`.
        """
        return self.model(input_ids, positions, kv_cache, metadata)

    @torch.inference_mode()
    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[num, hidden_size] -> [num, vocab_size] float32 logits, identical on every rank;
        written into `out` ([num, vocab_size] float32) where given, and `out` returned."""
        logits = self.lm_head.compute_logits(hidden_states)
        if out is None:
            return logits.float()
        if out.shape != logits.shape or out.dtype != torch.float32:
            raise ValueError(f"out: {out.dtype} {tuple(out.shape)}, logits {tuple(logits.shape)}")
        return out.copy_(logits)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of this rank's KV cache tensor for `num_blocks` blocks of `block_size` tokens."""
        return (
            self.config.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            self.num_kv_heads_per_rank,
            self.config.head_dim,
        )
