"""The serving thread budget: the node's usable cores but one, split among its ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedray.workers.cpu_threads import (
    PROMPT_HEAVY_TOKENS_PER_SEQUENCE,
    RESERVED_SERVING_CORES,
    SERVING_MS_PER_STREAMED_TOKEN,
    quiet_threads_per_rank,
    reserved_core_pays,
    serving_threads_per_rank,
    step_runs_on_every_core,
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


@given(st.integers(1, 512), st.integers(1, 64))
def test_a_quiet_step_takes_the_reserved_cores_too_and_no_more(cores: int, ranks: int) -> None:
    quiet = quiet_threads_per_rank(ranks, cores)
    assert quiet >= serving_threads_per_rank(ranks, cores)
    if cores >= ranks:
        assert quiet * ranks <= cores < (quiet + 1) * ranks
    else:
        assert quiet == 1


@pytest.mark.parametrize(
    ("streaming", "num_tokens", "num_sequences", "every_core"),
    [
        (False, 1, 1, True),  # nothing streams: every step
        (True, 64, 64, False),  # decodes of 64 streams
        (True, 2048, 44, True),  # a prompt chunk beside 43 decodes
        (True, 263, 64, False),  # a short prompt beside 63 decodes
        (True, 200, 1, True),  # a lone prompt: its first token sooner
        (True, PROMPT_HEAVY_TOKENS_PER_SEQUENCE - 1, 1, False),
    ],
)
def test_a_step_mostly_of_prompt_runs_on_every_core_while_requests_stream(
    streaming: bool, num_tokens: int, num_sequences: int, every_core: bool
) -> None:
    assert step_runs_on_every_core(streaming, num_tokens, num_sequences) is every_core


@given(st.integers(1, 8192), st.integers(1, 256), st.integers(1, 64))
def test_more_prompt_per_sequence_never_takes_cores_away(
    num_tokens: int, num_sequences: int, more: int
) -> None:
    if step_runs_on_every_core(True, num_tokens, num_sequences):
        assert step_runs_on_every_core(True, num_tokens + more, num_sequences)
        assert step_runs_on_every_core(False, num_tokens, num_sequences)


def test_no_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        serving_threads_per_rank(0, 8)
    with pytest.raises(ValueError, match="at least 1"):
        quiet_threads_per_rank(0, 8)


def _v2_root(tmp_path: Path, proc_text: str) -> tuple[Path, Path]:
    """A v2 mount (with cgroup.controllers) and a /proc/self/cgroup that reads `proc_text`."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text(proc_text)
    return root, proc


def test_a_cgroup_quota_caps_the_affinity(tmp_path: Path) -> None:
    """v2 in a cgroup namespace: the mount is the container's own cgroup."""
    affinity = len(os.sched_getaffinity(0))
    root, proc = _v2_root(tmp_path, "0::/\n")
    assert usable_cores(proc, root) == affinity  # no cpu.max at all
    (root / "cpu.max").write_text("max 100000\n")
    assert usable_cores(proc, root) == affinity
    (root / "cpu.max").write_text("50000 100000\n")  # half a core: still one
    assert usable_cores(proc, root) == 1
    (root / "cpu.max").write_text(f"{(affinity + 3) * 100000} 100000\n")  # above the affinity
    assert usable_cores(proc, root) == affinity
    assert usable_cores(tmp_path / "absent", root) == affinity  # no /proc/self/cgroup


def test_a_pod_quota_above_the_container_counts_seen_from_the_host(tmp_path: Path) -> None:
    """No cgroup namespace: the process's path is looked up under the mount, and a quota on an
    ancestor (a Kubernetes pod's, above its containers') caps it as its own would."""
    root, proc = _v2_root(tmp_path, "0::/kubepods/pod7/app\n")
    container = root / "kubepods" / "pod7" / "app"
    container.mkdir(parents=True)
    (container / "cpu.max").write_text("max 100000\n")
    assert usable_cores(proc, root) == len(os.sched_getaffinity(0))
    (container.parent / "cpu.max").write_text("100000 100000\n")  # the pod: one core
    assert usable_cores(proc, root) == 1


def test_a_cgroup_v1_quota_counts_where_there_is_no_v2(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v1 = root / "cpu" / "docker" / "c1"
    v1.mkdir(parents=True)
    proc = tmp_path / "self_cgroup"
    proc.write_text("4:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert usable_cores(proc, root) == len(os.sched_getaffinity(0))
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")  # one core
    assert usable_cores(proc, root) == 1


@pytest.mark.skipif(not Path("/proc/self/cgroup").exists(), reason="no cgroups: not Linux")
def test_this_machine_reads_within_its_affinity() -> None:
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("work_ms", "serving_threads", "all_threads", "pays"),
    [
        (1.8, 1, 2, True),  # the small model at 16 rows: 0.9 ms saved
        (96.0, 1, 2, False),  # the 0.5B shape: 48 ms saved, far past the serving path's 6.4
        (96.0, 15, 16, True),  # on 16 cores the reserve is one core of 16: 0.4 ms saved
        # Either side of saving just what the serving path costs for 16 streamed tokens:
        (2 * (16 * SERVING_MS_PER_STREAMED_TOKEN - 0.1), 1, 2, True),
        (2 * (16 * SERVING_MS_PER_STREAMED_TOKEN + 0.1), 1, 2, False),
    ],
)
def test_the_reserve_pays_unless_every_core_saves_more_than_serving_costs(
    work_ms: float, serving_threads: int, all_threads: int, pays: bool
) -> None:
    assert reserved_core_pays(work_ms / 1000, 16, serving_threads, all_threads) is pays
