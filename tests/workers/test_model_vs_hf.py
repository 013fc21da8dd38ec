"""Our paged Llama-family model against transformers' own forward, on tiny random checkpoints.

Each architecture is saved with `save_pretrained` (one sharded, one bf16) and loaded through our
config parser and weight loader, so the whole path from disk to logits is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedray.attention import cpu_kernels
from pagedray.attention.backend import TORCH_BACKEND
from pagedray.attention.cpu_backend import CPU_BACKEND
from pagedray.attention.metadata import AttentionMetadata
from pagedray.workers.layers.gemm import pack_module_weights
from pagedray.workers.layers.rotary import compute_inv_freq
from pagedray.workers.model_config import ModelConfig
from pagedray.workers.models.llama import LlamaForCausalLM
from pagedray.workers.parallel_state import TensorParallelGroup
from pagedray.workers.weight_loader import load_weights

BLOCK_SIZE = 16
NUM_BLOCKS = 40
VOCAB_SIZE = 300
ATOL = 1e-4
# Scattered, non-contiguous physical blocks for the two sequences.
BLOCK_TABLES = [[17, 3, 29], [8, 31, 0, 22]]
PROMPT_LENS = [21, 37]

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# name -> (config, save_pretrained kwargs, dtype saved)
CASES = {
    "llama": (
        transformers.LlamaConfig(
            **_COMMON, rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True
        ),
        {},
        torch.float32,
    ),
    "mistral": (transformers.MistralConfig(**_COMMON), {"max_shard_size": "40KB"}, torch.float32),
    "qwen2": (transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True), {}, torch.bfloat16),
    "qwen3": (transformers.Qwen3Config(**_COMMON, head_dim=32), {}, torch.float32),
}


def save_tiny_checkpoint(
    config: transformers.PretrainedConfig, path: Path, save_dtype: torch.dtype, **save_kwargs: str
) -> None:
    """A seeded random HF model; norms and biases randomised too, so loading them is tested."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.to(save_dtype).save_pretrained(path, **save_kwargs)


def build_metadata(
    block_tables: list[list[int]], num_computed: list[int], num_new: list[int]
) -> AttentionMetadata:
    """Metadata for a ragged step: sequence i has num_new[i] tokens after num_computed[i]."""
    slots: list[int] = []
    for table, computed, new in zip(block_tables, num_computed, num_new):
        for pos in range(computed, computed + new):
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    starts = [0]
    for new in num_new:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in zip(num_computed, num_new)]
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def run_step(
    model: LlamaForCausalLM,
    kv_cache: torch.Tensor,
    tokens: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
) -> list[torch.Tensor]:
    """Forward the new tokens of each sequence; returns per-sequence [num_new, vocab] logits."""
    input_ids, positions = [], []
    for seq, computed, new in zip(tokens, num_computed, num_new):
        input_ids += seq[computed : computed + new]
        positions += list(range(computed, computed + new))
    metadata = build_metadata(BLOCK_TABLES[: len(tokens)], num_computed, num_new)
    hidden = model(torch.tensor(input_ids), torch.tensor(positions), kv_cache, metadata)
    logits = model.compute_logits(hidden)
    return list(logits.split(num_new))


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


# The torch reference backend, and the CPU backend's C kernels (rotation + K/V store in one pass,
# paged decode and prefill attention) where they build.
BACKENDS = [TORCH_BACKEND, CPU_BACKEND] if cpu_kernels.available() else [TORCH_BACKEND]


@pytest.fixture(
    scope="module",
    params=[(case, backend) for case in CASES for backend in BACKENDS],
    ids=[f"{case}-{backend.name}" for case in CASES for backend in BACKENDS],
)
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF reference, our model) in float32, both loaded from the same saved checkpoint."""
    torch.set_num_threads(1)
    case, backend = request.param
    config, save_kwargs, save_dtype = CASES[case]
    path = tmp_path_factory.mktemp(case)
    save_tiny_checkpoint(config, path, save_dtype, **save_kwargs)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model_config = ModelConfig.from_pretrained(path, dtype="float32")
    model = LlamaForCausalLM(model_config, TensorParallelGroup(0, 1), backend)
    load_weights(model, path)
    if backend is CPU_BACKEND:
        pack_module_weights(model)  # as a CPU worker does: products on oneDNN's packed weights
    return hf_model, model


def new_kv_cache(model: LlamaForCausalLM) -> torch.Tensor:
    return torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE))


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_prefill_then_decode_matches_hf(models: tuple[torch.nn.Module, LlamaForCausalLM]) -> None:
    hf_model, model = models
    kv_cache = new_kv_cache(model)
    seqs = prompts()
    # (a) both prompts prefilled in one ragged call.
    out = run_step(model, kv_cache, seqs, [0, 0], PROMPT_LENS)
    for seq, logits in zip(seqs, out):
        torch.testing.assert_close(logits, hf_logits(hf_model, seq), atol=ATOL, rtol=0)
    # (b) three batched decode steps, feeding arbitrary (not argmax) tokens.
    for step in range(3):
        for i, seq in enumerate(seqs):
            seq.append((7 * step + 13 * i + 5) % VOCAB_SIZE)
        out = run_step(model, kv_cache, seqs, [len(s) - 1 for s in seqs], [1, 1])
        for seq, logits in zip(seqs, out):
            torch.testing.assert_close(logits, hf_logits(hf_model, seq)[-1:], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf(models: tuple[torch.nn.Module, LlamaForCausalLM]) -> None:
    hf_model, model = models
    kv_cache = new_kv_cache(model)
    seqs = prompts()
    first = [16, 20]  # first chunks: one exactly a block, one ending mid-block
    out_first = run_step(model, kv_cache, seqs, [0, 0], first)
    rest = [n - f for n, f in zip(PROMPT_LENS, first)]
    out_rest = run_step(model, kv_cache, seqs, first, rest)
    for seq, a, b in zip(seqs, out_first, out_rest):
        torch.testing.assert_close(torch.cat([a, b]), hf_logits(hf_model, seq), atol=ATOL, rtol=0)


def test_decode_batched_with_prefill_chunk(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    hf_model, model = models
    kv_cache = new_kv_cache(model)
    seqs = prompts()
    run_step(model, kv_cache, seqs[:1], [0], [PROMPT_LENS[0]])
    seqs[0].append(42)
    # Sequence 0 decodes while sequence 1 prefills its whole prompt in the same step.
    out = run_step(model, kv_cache, seqs, [PROMPT_LENS[0], 0], [1, PROMPT_LENS[1]])
    torch.testing.assert_close(out[0], hf_logits(hf_model, seqs[0])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf_model, seqs[1]), atol=ATOL, rtol=0)


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CASES["llama"][0]
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    parsed = ModelConfig.from_dict({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    actual = compute_inv_freq(parsed.head_dim, parsed.rope_theta, parsed.rope_scaling)
    assert torch.equal(actual, expected)


def test_config_parsing(tmp_path: Path) -> None:
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "eos_token_id": [1, 2],
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.eos_token_id == (1, 2) and config.dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(tmp_path, dtype="float16").dtype == torch.float16
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        ModelConfig.from_dict({**legacy, "architectures": ["GPT2LMHeadModel"]})


def test_bf16_checkpoint_auto_dtype(tmp_path: Path) -> None:
    config, _, _ = CASES["qwen2"]
    save_tiny_checkpoint(config, tmp_path, torch.bfloat16)
    model_config = ModelConfig.from_pretrained(tmp_path)
    assert model_config.dtype == torch.bfloat16
    assert model_config.attention_bias and not model_config.o_proj_bias
    model = LlamaForCausalLM(model_config, TensorParallelGroup(0, 1), TORCH_BACKEND)
    load_weights(model, tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    kv_cache = new_kv_cache(model).to(torch.bfloat16)
    seqs = prompts()
    out = run_step(model, kv_cache, seqs, [0, 0], PROMPT_LENS)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    for seq, logits in zip(seqs, out):
        torch.testing.assert_close(logits, hf_logits(hf_model, seq), atol=0.1, rtol=0.05)


def test_missing_weight_is_reported(tmp_path: Path) -> None:
    config, _, _ = CASES["qwen3"]
    save_tiny_checkpoint(config, tmp_path, torch.float32)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model_config = ModelConfig.from_pretrained(tmp_path)
    model = LlamaForCausalLM(model_config, TensorParallelGroup(0, 1), TORCH_BACKEND)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*'k'"):
        load_weights(model, tmp_path)


@pytest.mark.parametrize("backend", BACKENDS, ids=[b.name for b in BACKENDS])
def test_bf16_close_to_hf_float32(tmp_path: Path, backend) -> None:
    """bf16 weights and KV through every path (C norm, rotation, prefill and decode kernels on
    the CPU backend): logits within bf16's error of HF's float32 ones, prefill and decode."""
    config, save_kwargs, save_dtype = CASES["llama"]
    save_tiny_checkpoint(config, tmp_path, save_dtype, **save_kwargs)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model_config = ModelConfig.from_pretrained(tmp_path, dtype="bfloat16")
    model = LlamaForCausalLM(model_config, TensorParallelGroup(0, 1), backend)
    model.to(dtype=torch.bfloat16)
    load_weights(model, tmp_path)
    kv_cache = torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), dtype=torch.bfloat16)
    seqs = prompts()
    outs = run_step(model, kv_cache, seqs, [0, 0], PROMPT_LENS)
    for seq in seqs:
        seq.append(11)
    outs += run_step(model, kv_cache, seqs, PROMPT_LENS, [1, 1])
    wants = [hf_logits(hf_model, seq[:-1]) for seq in seqs] + [
        hf_logits(hf_model, seq)[-1:] for seq in seqs
    ]
    for got, want in zip(outs, wants):
        scale = want.abs().max()
        torch.testing.assert_close(got, want, atol=0.05 * float(scale), rtol=0)
