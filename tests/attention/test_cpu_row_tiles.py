"""The row-tile kernel (attention/cpu_row_tiles.py): how a step's rows are cut into tiles never
changes a bit of any row, the rows match the torch reference, and what it cannot read it refuses.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paged_batch import assert_close, random_batch, shared_prefix_batch
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
        plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, seq_lens, block_size, rows)
        cpu_row_tiles.paged_rows(
            query, key_cache, value_cache, batch.block_tables, plan, scale, out
        )
        return out

    one_row_each = attend(1)  # every row as a decode of its own
    assert torch.equal(attend(tile_rows), one_row_each)
    assert_close(
        one_row_each, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale)
    )


@settings(max_examples=25, deadline=None)
@given(
    # (prefix blocks, each member's tokens past them): members may end inside the prefix's last
    # block or fill it exactly (0).
    families=st.lists(
        st.tuples(st.integers(1, 5), st.lists(st.integers(0, 40), min_size=1, max_size=6)),
        min_size=1,
        max_size=3,
    ),
    prefills=st.lists(st.tuples(st.integers(2, 30), st.integers(0, 40)), max_size=2),
    shape=st.sampled_from([(4, 2, 64, 16), (14, 2, 64, 16), (3, 3, 128, 12), (6, 2, 80, 8)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    tile_rows=st.integers(2, 6),
    order=st.randoms(use_true_random=False),
)
def test_decodes_behind_a_shared_prefix_read_it_once_with_the_same_bits(
    families: list[tuple[int, list[int]]],
    prefills: list[tuple[int, int]],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    tile_rows: int,
    order: random.Random,
) -> None:
    """Decodes whose tables begin with the same blocks share tiles that read those blocks once;
    each row's bits are those it has alone."""
    if not cpu_row_tiles.supports(dtype, shape[2]):
        pytest.skip(f"head size {shape[2]} is no multiple of {cpu_row_tiles.lanes()} lanes here")
    query, key_cache, value_cache, batch, scale = shared_prefix_batch(
        families, prefills, shape, dtype, order
    )
    block_size, tables = shape[3], batch.block_tables
    starts, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu

    def attend(plan: cpu_row_tiles.RowTiles) -> torch.Tensor:
        out = torch.full_like(query, float("nan"))
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables, plan, scale, out)
        return out

    shared = cpu_row_tiles.plan_tiles(starts, seq_lens, block_size, tile_rows, tables)
    # A family of two or more shares a tile, reading at least its first block once.
    if any(len(extras) >= 2 for _, extras in families):
        assert any(count >= 2 and blocks >= 1 for _, count, blocks in shared.tiles.tolist())
    entries = shared.entries.tolist()
    for first, count, blocks in shared.tiles.tolist():
        tile = entries[first : first + count]
        assert blocks <= -(-max(keys for _, keys, _ in tile) // block_size)
        several = len({seq for _, _, seq in tile}) > 1
        for _, keys, seq in tile:  # what a tile reads once is in every member's table alike
            assert torch.equal(tables[seq, :blocks], tables[tile[0][2], :blocks])
            assert not several or blocks <= -(-keys // block_size)  # within each one's keys
    assert sorted(row for row, _, _ in entries) == list(range(query.shape[0]))
    alone = attend(cpu_row_tiles.plan_tiles(starts, seq_lens, block_size, 1))
    assert torch.equal(attend(shared), alone)
    assert_close(alone, torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))


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
    plan = cpu_row_tiles.plan_tiles(starts, seq_lens, 16, tile_rows)
    keys_of_row = {}
    entries = plan.entries.tolist()
    for first, count, shared in plan.tiles.tolist():
        assert 1 <= count <= tile_rows and count <= plan.max_rows
        tile = entries[first : first + count]
        assert len({seq for _, _, seq in tile}) == 1  # no tables given: one sequence a tile
        assert shared == -(-max(keys for _, keys, _ in tile) // 16)
        for row, keys, seq in tile:
            assert row not in keys_of_row
            keys_of_row[row] = (keys, seq)
    expected = {}
    for seq, (start, end) in enumerate(zip(starts, starts[1:])):
        for row in range(start, end):
            expected[row] = (seq_lens[seq] - (end - row) + 1, seq)
    assert keys_of_row == expected
    assert plan.max_seq_len == max(seq_lens)


@pytest.mark.parametrize("seq_lens", [[700], [300, 5, 77, 129]], ids=["one", "four"])
def test_same_bits_on_one_and_two_threads(seq_lens: list[int]) -> None:
    """Few tiles split by KV head, many go a tile a thread: a row's sums are the same."""
    query_lens = [min(n, 40) for n in seq_lens]
    query, key_cache, value_cache, batch, scale = random_batch(
        query_lens, seq_lens, 8, 2, 64, 16, torch.float32
    )
    plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, seq_lens, 16)
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
    plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, batch.seq_lens_cpu, 16)
    tables = batch.block_tables
    with pytest.raises(ValueError, match="that is not there"):
        cpu_row_tiles.paged_rows(query[:5], key_cache, value_cache, tables, plan, scale, out[:5])
    with pytest.raises(ValueError, match="that is not there"):
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables[:1], plan, scale, out)
    with pytest.raises(ValueError, match="more than 19"):  # would overrun the scores scratch
        short = plan._replace(max_seq_len=19)
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables, short, scale, out)
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_row_tiles.paged_rows(
            query, key_cache.double(), value_cache.double(), tables, plan, scale, out
        )
    decode = next(i for i, (first, _, _) in enumerate(plan.tiles.tolist()) if first == 0)
    assert plan.entries[0].tolist() == [5, 9, 1]  # decodes first: the second sequence's
    with pytest.raises(ValueError, match="shares more blocks"):  # the decode has 1 block
        tiles = plan.tiles.clone()
        tiles[decode, 2] = 2
        overshared = plan._replace(tiles=tiles)
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, tables, overshared, scale, out)
    with pytest.raises(ValueError, match="names an entry"):
        tiles = plan.tiles.clone()
        tiles[-1, 1] = tiles[-1, 1] + 1  # one past the last entry
        cpu_row_tiles.paged_rows(
            query, key_cache, value_cache, tables, plan._replace(tiles=tiles), scale, out
        )
    with pytest.raises(ValueError, match="tables that differ"):  # two decodes, no block alike
        q2, k2, v2, pair, _ = random_batch([1, 1], [20, 20], 4, 2, 64, 16, torch.float32)
        plan2 = cpu_row_tiles.plan_tiles(pair.query_start_loc_cpu, pair.seq_lens_cpu, 16)
        one_tile = plan2._replace(tiles=torch.tensor([[0, 2, 1]]), max_rows=2)
        cpu_row_tiles.paged_rows(q2, k2, v2, pair.block_tables, one_tile, scale, q2.clone())
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
import random, sys, torch
sys.path.insert(0, {tests!r})
from _paged_batch import assert_close, random_batch, shared_prefix_batch, shared_prefix_batch
from pagedray.attention import cpu_row_tiles, torch_ref
assert cpu_row_tiles.lanes() == 16, cpu_row_tiles.lanes()
for dtype in (torch.float32, torch.bfloat16):
    query, key_cache, value_cache, batch, scale = random_batch(
        [37, 1, 20], [90, 33, 20], 6, 2, 80, 12, dtype
    )
    outs = []
    for rows in (1, 5, 16):
        out = torch.empty_like(query)
        plan = cpu_row_tiles.plan_tiles(batch.query_start_loc_cpu, batch.seq_lens_cpu, 12, rows)
        every = batch.block_tables
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, every, plan, scale, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs)
    assert_close(outs[0], torch_ref.paged_attention(query, key_cache, value_cache, batch, scale))
    # Decodes behind shared prefixes, a tile of them against each alone.
    query, key_cache, value_cache, batch, scale = shared_prefix_batch(
        [(3, [0, 5, 30, 17]), (1, [9, 2])], [(20, 11)], (6, 2, 80, 12), dtype, random.Random(1)
    )
    outs = []
    for rows, tables in ((1, None), (16, batch.block_tables)):
        out = torch.empty_like(query)
        starts, lens = batch.query_start_loc_cpu, batch.seq_lens_cpu
        plan = cpu_row_tiles.plan_tiles(starts, lens, 12, rows, tables)
        assert (plan.max_rows > 1) == (tables is not None)
        every = batch.block_tables
        cpu_row_tiles.paged_rows(query, key_cache, value_cache, every, plan, scale, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
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
