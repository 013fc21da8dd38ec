"""The row-tile kernel (attention/cpu_row_tiles.py): how a step's rows are cut into tiles never
changes a bit of any row, the rows match the torch reference, and what it cannot read it refuses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paged_batch import assert_close, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.attention import cpu_backend, cpu_kernels, cpu_row_tiles, torch_ref

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the C kernels did not build here (no C compiler)"
)


def _sequences() -> st.SearchStrategy[list[tuple[int, int]]]:
    """(query_len, context before the step) per sequence: decodes, fresh and cached prefills."""
    one = st.tuples(st.integers(1, 50), st.integers(0, 70))
    return st.lists(one, min_size=1, max_size=4)


@settings(max_examples=20, deadline=None)
@given(
    sequences=_sequences(),
    # (heads, KV heads, head size, block size): GQA 1-7, a block size that is no multiple of a
    # vector's lanes (groups of keys cross blocks), head sizes of 1-16 vectors.
    shape=st.sampled_from([(4, 2, 64, 16), (14, 2, 64, 16), (3, 3, 128, 12), (6, 2, 80, 8)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    tile_rows=st.integers(1, 24),
)
def test_any_tiling_gives_the_same_bits(
    sequences: list[tuple[int, int]],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    tile_rows: int,
) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    if not cpu_row_tiles.supports(dtype, head_dim):
        pytest.skip(f"head size {head_dim} is no multiple of {cpu_row_tiles.lanes()} lanes here")
    query_lens = [q for q, _ in sequences]
    seq_lens = [q + context for q, context in sequences]
    query, key_cache, value_cache, batch, scale = random_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )

    def attend(rows: int) -> torch.Tensor:
        out = torch.full_like(query, float("nan"))
        plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, seq_lens, rows)
        cpu_row_tiles.paged_rows(
            query, key_cache, value_cache, batch.block_tables, plan, scale, out
        )
        return out

    one_row_each = attend(1)  # every row as a decode of its own
    assert torch.equal(attend(tile_rows), one_row_each)
    assert_close(
        one_row_each, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale)
    )


@given(
    query_lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    tile_rows=st.integers(1, 20),
)
def test_tiles_cover_each_row_once_with_its_own_context(
    query_lens: list[int], tile_rows: int
) -> None:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    seq_lens = [n + 3 * i for i, n in enumerate(query_lens)]
    plan = cpu_row_tiles.plan_tiles(starts, seq_lens, tile_rows)
    keys_of_row = {}
    for first, rows, keys, seq in plan.tiles.tolist():
        assert 1 <= rows <= tile_rows and rows <= plan.max_rows
        for i in range(rows):
            assert first + i not in keys_of_row
            keys_of_row[first + i] = (keys + i, seq)
    expected = {}
    for seq, (start, end) in enumerate(zip(starts, starts[1:])):
        for row in range(start, end):
            expected[row] = (seq_lens[seq] - (end - row) + 1, seq)
    assert keys_of_row == expected
    assert plan.rows_end == starts[-1] or not plan.tiles.numel()
    assert plan.max_seq_len == max(seq_lens)


@pytest.mark.parametrize("seq_lens", [[700], [300, 5, 77, 129]], ids=["one", "four"])
def test_same_bits_on_one_and_two_threads(seq_lens: list[int]) -> None:
    """Few tiles split by KV head, many go a tile a thread: a row's sums are the same."""
    query_lens = [min(n, 40) for n in seq_lens]
    query, key_cache, value_cache, batch, scale = random_batch(
        query_lens, seq_lens, 8, 2, 64, 16, torch.float32
    )
    plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, seq_lens)
    before = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty_like(query)
            cpu_row_tiles.paged_rows(
                query, key_cache, value_cache, batch.block_tables, plan, scale, out
            )
            outputs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])


def test_rejects_what_it_cannot_read() -> None:
    query, key_cache, value_cache, batch, scale = random_batch(
        [5, 1], [20, 9], 4, 2, 64, 16, torch.float32
    )
    out = torch.empty_like(query)
    plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, batch.seq_lens_cpu)
    tables = batch.block_tables
    with pytest.raises(ValueError, match="outside block_tables or query"):
        cpu_row_tiles.paged_rows(query[:5], key_cache, value_cache, tables, plan, scale, out[:5])
    with pytest.raises(ValueError, match="outside block_tables or query"):
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables[:1], plan, scale, out)
    with pytest.raises(ValueError, match="more than 19"):  # would overrun the scores scratch
        short = plan._replace(max_seq_len=19)
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables, short, scale, out)
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_row_tiles.paged_rows(
            query, key_cache.double(), value_cache.double(), tables, plan, scale, out
        )
    odd = cpu_row_tiles.lanes() + 4
    assert not cpu_row_tiles.supports(torch.float32, odd)
    with pytest.raises(ValueError, match=f"head size {odd}"):
        q = torch.zeros(6, 2, odd)
        cache = torch.zeros(4, 16, 2, odd)
        cpu_row_tiles.paged_rows(q, cache, cache, tables, plan, scale, torch.empty_like(q))
    cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables, plan, scale, out)
    assert_close(out, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))


def test_exact_rows_are_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing set, the backend sends every row through the tiles."""
    monkeypatch.delenv(cpu_backend.EXACT_ATTENTION_ENV, raising=False)
    cpu_backend.exact_rows.cache_clear()
    try:
        query, key_cache, value_cache, batch, scale = random_batch(
            [30, 1], [30, 50], 4, 2, 64, 16, torch.float32
        )
        out = cpu_backend.paged_attention(query, key_cache, value_cache, batch, scale)
        assert "cpu.tiles" in batch.scratch
        batch.scratch.clear()
        assert_close(out, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))
    finally:
        monkeypatch.undo()
        cpu_backend.exact_rows.cache_clear()


_SIXTEEN_LANES = """
import torch, sys
sys.path.insert(0, {tests!r})
from _paged_batch import assert_close, random_batch
from pagedray.attention import cpu_row_tiles, torch_ref
assert cpu_row_tiles.lanes() == 16, cpu_row_tiles.lanes()
for dtype in (torch.float32, torch.bfloat16):
    query, key_cache, value_cache, batch, scale = random_batch(
        [37, 1, 20], [90, 33, 20], 6, 2, 80, 12, dtype
    )
    outs = []
    for rows in (1, 5, 16):
        out = torch.empty_like(query)
        plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, batch.seq_lens_cpu, rows)
        tables = batch.block_tables
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables, plan, scale, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs)
    assert_close(outs[0], torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))
print("ok")
"""


def test_the_sixteen_lane_build_keeps_its_bits_by_any_tiling(tmp_path: Path) -> None:
    """The arithmetic a CPU with AVX-512 builds (16 lanes, another sum tree), built here with
    PAGEDRAY_ROWS_W16 (the compiler splits the vectors) in a process of its own. Also how $CC
    may be a command line (`ccache gcc`, `gcc -m64`): 16 lanes only if its flag reached the
    compiler."""
    compiler = os.environ.get("CC") or "cc"
    env = {
        **os.environ,
        "CC": f"{compiler} -DPAGEDRAY_ROWS_W16",
        "PAGEDRAY_CACHE_DIR": str(tmp_path),
    }
    script = _SIXTEEN_LANES.format(tests=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
