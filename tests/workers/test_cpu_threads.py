"""The serving thread budget: the node's usable cores but one, split among its ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedray.workers.cpu_threads import (
    RESERVED_SERVING_CORES,
    serving_threads_per_rank,
    usable_cores,
)


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"),
    [(2, 1, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (2, 4, 1), (64, 8, 7)],
)
def test_examples(cores: int, ranks: int, threads: int) -> None:
    assert serving_threads_per_rank(ranks, cores) == threads


@given(st.integers(1, 512), st.integers(1, 64))
def test_every_rank_gets_a_thread_and_one_core_stays_free_where_there_is_one(
    cores: int, ranks: int
) -> None:
    threads = serving_threads_per_rank(ranks, cores)
    assert threads >= 1
    if cores - RESERVED_SERVING_CORES >= ranks:  # room for a thread each beside the reserve
        assert threads * ranks <= cores - RESERVED_SERVING_CORES
        assert (threads + 1) * ranks > cores - RESERVED_SERVING_CORES  # and none wasted
    else:
        assert threads == 1


def test_no_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        serving_threads_per_rank(0, 8)


def test_a_cgroup_quota_caps_the_affinity(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == affinity
    cpu_max.write_text("50000 100000\n")  # half a core: still one
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text(f"{(affinity + 3) * 100000} 100000\n")  # a quota above the affinity
    assert usable_cores(cpu_max) == affinity
    assert usable_cores(tmp_path / "absent") == affinity
