"""The C paged-attention kernels (the CPU backend: row tiles, and by path decode and prefill)
against the plain-torch reference.

Also how the kernel library is built: cached per machine, safe to build from several processes at
once, harmless to the process that loads it, and replaced by the torch reference where no C
compiler works.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paged_batch import SHAPES, assert_close, check_against_reference, random_batch

from pagedray.attention import cpu_kernels, torch_ref
from pagedray.attention.backend import ENV_VAR
from pagedray.attention.cpu_backend import CPU_BACKEND

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no working C compiler: the CPU kernels cannot be built"
)


# (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
_check = functools.partial(check_against_reference, CPU_BACKEND.paged_attention)


@pytest.fixture(params=["exact_attention", "attention_by_path"])
def attention_setting(request: pytest.FixtureRequest) -> str:
    """A test of the backend's output on both of its settings: exact rows (the row-tile kernel)
    and by path (the decode kernel, the prefill kernel or SDPA)."""
    request.getfixturevalue(request.param)
    return str(request.param)


@pytest.mark.usefixtures("attention_setting")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", SHAPES)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size, dtype) -> None:
    # seq_len 1: no cached context; 32: ends exactly on a block boundary for every block size.
    _check([1] * 4, [1, 32, 45, 97], num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.usefixtures("attention_setting")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", SHAPES)
def test_mixed_batch_matches_reference(
    num_heads, num_kv_heads, head_dim, block_size, dtype
) -> None:
    # Decodes between prefill chunks (the C prefill kernel with AVX-512, torch without), with
    # and without cached context.
    query_lens, seq_lens = [19, 1, 7, 1, 24, 1], [19, 33, 64, 16, 50, 90]
    _check(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefills_over_cached_context(dtype: torch.dtype, attention_setting: str) -> None:
    # Many query tiles and key chunks; a 600-token cached prefix read in place; odd lengths.
    if attention_setting == "attention_by_path" and not cpu_kernels.prefill_supported(dtype, 64):
        pytest.skip("no AVX-512 here: prefill chunks take the torch path")
    _check([300, 1, 70, 33], [900, 30, 70, 34], 8, 2, 64, 16, dtype)
    _check([129, 17], [129, 1040], 4, 4, 128, 32, dtype)


@pytest.mark.usefixtures("attention_setting")
def test_float16() -> None:
    if not cpu_kernels.supports(torch.float16):
        pytest.skip("this C compiler has no _Float16")
    _check([1, 1, 5], [7, 200, 40], 8, 2, 64, 16, torch.float16)


@pytest.mark.usefixtures("attention_setting")
def test_long_decodes() -> None:
    _check([1] * 5, [1500, 600, 257, 3, 1024], 4, 2, 64, 16, torch.float32)


@pytest.mark.usefixtures("attention_setting")
def test_query_as_view_of_fused_projection() -> None:
    """The model hands over q as a strided view of its fused qkv output."""
    query, key_cache, value_cache, metadata, scale = random_batch(
        [1, 1, 1], [10, 40, 70], 4, 2, 64, 16, torch.float32
    )
    fused = torch.randn(3, (4 + 2 * 2) * 64)
    fused[:, : 4 * 64] = query.reshape(3, -1)
    view = fused[:, : 4 * 64].view(3, 4, 64)
    assert not view.is_contiguous()
    expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, scale)
    metadata.scratch.clear()
    assert_close(
        CPU_BACKEND.paged_attention(view, key_cache, value_cache, metadata, scale), expected
    )


def test_kernel_runs_on_torchs_thread_count() -> None:
    assert cpu_kernels.parallel_width(2) == 2  # the OpenMP build loaded, not the serial one
    assert cpu_kernels.parallel_width(1) == 1


@pytest.mark.usefixtures("attention_setting")
@pytest.mark.parametrize("seq_lens", [[1000], [300, 5, 77, 129, 16, 1000]], ids=["one", "six"])
def test_same_bits_on_one_and_two_threads(seq_lens: list[int]) -> None:
    """One decode on two threads splits by KV head; more go one sequence a thread. Either way a
    head's sums run in the same order, so the outputs agree to the bit, and with the reference."""
    batch = random_batch([1] * len(seq_lens), seq_lens, 8, 2, 64, 16, torch.float32)
    expected = torch_ref.paged_attention(*batch)
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batch[3].scratch.clear()
            outputs.append(CPU_BACKEND.paged_attention(*batch))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])
    assert_close(outputs[1], expected)


@pytest.mark.usefixtures("attention_setting")
def test_block_offsets_past_int32() -> None:
    """Block ids whose element offsets pass 2^31, in an 8 GiB pool only a few pages of which
    are ever touched (torch.empty)."""
    block_size, num_kv_heads, head_dim = 16, 1, 64
    first_high = 2**31 // (block_size * num_kv_heads * head_dim) + 1
    kv_cache = torch.empty(
        2, first_high + 8, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16
    )
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    query, small_k, small_v, metadata, scale = random_batch(
        [1, 1], [40, 20], 4, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    expected = torch_ref.paged_attention(query, small_k, small_v, metadata, scale)
    # The same contents, moved to the high block ids.
    used = sorted(set(metadata.block_tables.flatten().tolist()))
    high = {old: first_high + i for i, old in enumerate(used)}
    for old, new in high.items():
        key_cache[new], value_cache[new] = small_k[old], small_v[old]
    metadata.block_tables = metadata.block_tables.apply_(lambda b: high[b])
    metadata.scratch.clear()
    assert_close(
        CPU_BACKEND.paged_attention(query, key_cache, value_cache, metadata, scale), expected
    )


def test_rejects_what_it_cannot_read() -> None:
    query, key_cache, value_cache, metadata, scale = random_batch(
        [1], [10], 4, 2, 64, 16, torch.float32
    )
    out = torch.empty_like(query)
    tables, lens, starts, seqs = (
        metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, torch.tensor([0])
    )  # fmt: skip
    args = (lens, starts, seqs, 10, scale, out)
    with pytest.raises(ValueError, match="block_tables"):
        cpu_kernels.paged_decode(query, key_cache, value_cache, tables.long(), *args)
    with pytest.raises(ValueError, match="share a dtype"):
        cpu_kernels.paged_decode(query, key_cache.double(), value_cache.double(), tables, *args)
    with pytest.raises(ValueError, match="max_seq_len=9"):  # would overrun the scores scratch
        short = (lens, starts, seqs, 9, scale, out)
        cpu_kernels.paged_decode(query, key_cache, value_cache, tables, *short)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.paged_decode(query, key_cache.transpose(1, 2), value_cache, tables, *args)
    cpu_kernels.paged_decode(query, key_cache, value_cache, tables, *args)  # and it still works
    metadata.scratch.clear()
    assert_close(out, torch_ref.paged_attention(query, key_cache, value_cache, metadata, scale))


_PROBE = """
import json, torch
from pagedray.attention import cpu_kernels
from pagedray.attention.backend import select_backend
available = cpu_kernels.available()
# A denormal survives arithmetic unless something set flush-to-zero in this process.
denormal_kept = (torch.tensor([1e-39]) * 2.0).item() != 0.0
try:
    forced = select_backend(torch.device("cpu")).name
except ValueError as error:
    forced = "error: " + str(error)
print(json.dumps({"available": available, "denormal_kept": denormal_kept, "backend": forced}))
"""


def _probe(cache_dir: Path, **env: str) -> subprocess.Popen[str]:
    inherited = {k: v for k, v in os.environ.items() if k not in ("CC", ENV_VAR)}
    full_env = {**inherited, "PAGEDRAY_CACHE_DIR": str(cache_dir), **env}
    return subprocess.Popen(
        [sys.executable, "-c", _PROBE], env=full_env, stdout=subprocess.PIPE, text=True
    )


def _result(process: subprocess.Popen[str]) -> dict:
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 0
    return json.loads(stdout.strip().splitlines()[-1])


def test_concurrent_first_builds_share_one_cache(tmp_path: Path) -> None:
    probes = [_probe(tmp_path) for _ in range(2)]  # like the TP workers of one new engine
    for probe in probes:
        assert _result(probe) == {"available": True, "denormal_kept": True, "backend": "cpu"}
    kernels = tmp_path / "kernels"
    assert len(list(kernels.glob("*.so"))) == 1
    assert [p for p in kernels.iterdir() if p.suffix != ".so"] == []  # no build leftovers
    built = next(kernels.glob("*.so")).stat().st_mtime_ns
    assert _result(_probe(tmp_path))["backend"] == "cpu"
    assert next(kernels.glob("*.so")).stat().st_mtime_ns == built  # loaded, not rebuilt


def test_without_a_compiler_the_torch_reference_serves(tmp_path: Path) -> None:
    assert _result(_probe(tmp_path, CC="/bin/false")) == {
        "available": False,
        "denormal_kept": True,
        "backend": "torch",
    }
    forced = _result(_probe(tmp_path, CC="/bin/false", PAGEDRAY_ATTENTION_BACKEND="cpu"))
    assert forced["backend"].startswith("error: PAGEDRAY_ATTENTION_BACKEND=cpu")


def test_unwritable_cache_builds_in_a_private_folder(tmp_path: Path) -> None:
    """A read-only HOME or cache (random-UID pods) still gets the kernels, built privately in a
    temporary folder that is gone once the library is loaded."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = _result(_probe(blocked, TMPDIR=str(temp)))
    assert result == {"available": True, "denormal_kept": True, "backend": "cpu"}
    assert list(temp.iterdir()) == []
