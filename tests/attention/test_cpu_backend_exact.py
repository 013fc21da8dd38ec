"""The CPU backend's exact rows (the default, `PAGEDRAY_EXACT_ATTENTION=1`): a query row's
output is the same bits whether it is a decode, a row of a prefill chunk beside others, or the
last of a chunk that read its prefix from the cache — the property that lets a request resumed,
recomputed or batched draw the same tokens."""

from __future__ import annotations

import pytest
import torch
from _paged_batch import assert_close, metadata_on_blocks, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.attention import cpu_backend, cpu_kernels, torch_ref
from pagedray.attention.cpu_backend import CPU_BACKEND, paged_attention

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the C kernels did not build here (no C compiler)"
)

BLOCK = 16


def _sequences() -> st.SearchStrategy[list[tuple[int, int]]]:
    """(query_len, context before the step) per sequence: decodes, fresh and cached prefills."""
    one = st.tuples(st.integers(1, 70), st.integers(0, 90))
    return st.lists(one, min_size=1, max_size=5)


@pytest.mark.usefixtures("exact_attention")
@settings(max_examples=25, deadline=None)
@given(
    sequences=_sequences(),
    shape=st.sampled_from([(4, 2, 64), (14, 2, 64), (8, 8, 128), (6, 2, 80)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_every_row_is_the_same_bits_as_that_row_computed_as_a_decode(
    sequences: list[tuple[int, int]], shape: tuple[int, int, int], dtype: torch.dtype
) -> None:
    query_lens = [q for q, _ in sequences]
    seq_lens = [q + context for q, context in sequences]
    query, key_cache, value_cache, batch, scale = random_batch(
        query_lens, seq_lens, *shape, BLOCK, dtype
    )
    together = paged_attention(query, key_cache, value_cache, batch, scale)
    batch.scratch.clear()
    assert_close(together, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))

    row = 0
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for position in range(seq_len - query_len, seq_len):
            # The row alone: a decode at `position` on the same blocks.
            alone = metadata_on_blocks(
                [1], [position + 1], batch.block_tables[seq : seq + 1], BLOCK
            )
            one = paged_attention(query[row : row + 1], key_cache, value_cache, alone, scale)
            assert torch.equal(one[0], together[row]), (seq, position)
            row += 1


@pytest.mark.usefixtures("exact_attention")
def test_a_chunk_behind_a_cached_prefix_is_the_same_bits_as_the_whole_prompt() -> None:
    length, cached = 300, 137
    query, key_cache, value_cache, whole_batch, scale = random_batch(
        [length], [length], 4, 2, 64, BLOCK, torch.float32
    )
    whole = paged_attention(query, key_cache, value_cache, whole_batch, scale)
    suffix = metadata_on_blocks([length - cached], [length], whole_batch.block_tables, BLOCK)
    assert torch.equal(
        paged_attention(query[cached:], key_cache, value_cache, suffix, scale), whole[cached:]
    )


@pytest.mark.usefixtures("attention_by_path")
def test_with_the_setting_off_prefill_rows_take_the_prefill_kernels() -> None:
    """With `PAGEDRAY_EXACT_ATTENTION=0`, prefill rows go by their own kernel (the torch
    reference's SDPA or the AVX-512 prefill kernel), close to the reference."""
    length = 200
    query, key_cache, value_cache, batch, scale = random_batch(
        [length], [length], 4, 2, 64, BLOCK, torch.float32
    )
    by_path = paged_attention(query, key_cache, value_cache, batch, scale)
    assert "cpu.rows" not in batch.scratch and "cpu.tiles" not in batch.scratch
    batch.scratch.clear()
    assert_close(by_path, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))


@pytest.mark.usefixtures("attention_by_path")
def test_the_backends_arithmetic_names_its_setting_and_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What names the node's KV tier file beside the model layout: engines of either setting,
    or of another kernel build, never read each other's blocks."""
    by_path = CPU_BACKEND.arithmetic()
    monkeypatch.setenv(cpu_backend.EXACT_ATTENTION_ENV, "1")
    cpu_backend.exact_rows.cache_clear()  # the fixture clears it again after the test
    exact = CPU_BACKEND.arithmetic()
    assert by_path != exact
    assert cpu_kernels.build_key() in exact and torch.__version__ in exact
