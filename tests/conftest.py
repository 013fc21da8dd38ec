"""Shared fixtures: seeded tiny checkpoints built once per session, offline."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import clone_only
import pytest
import torch

clone_only.install()

# NOTE: two processes each running 2 OpenMP threads on 2 cores slow matmuls by 10x or more;
# the test process keeps to what it owns, spawned workers set their own.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run in the interpreter. It must be chosen before anything
# imports triton (torch._dynamo does, through transformers), since @triton.jit decides at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedray.tools.default_model import ARCHS  # noqa: E402
from pagedray.workers.host_kv_buffer import TIER_DIR_ENV, tier_dir  # noqa: E402

# Host KV tier files of this run, apart from any other run's and removed after it. Set before
# any engine, Ray cluster or server starts: they all inherit it.
os.environ[TIER_DIR_ENV] = tempfile.mkdtemp(prefix="pagedray-tests-kv-", dir=tier_dir())
atexit.register(shutil.rmtree, os.environ[TIER_DIR_ENV], True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from pagedray.tools.default_model import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(root / arch, arch=arch, preset="tiny", seed=0)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, str]) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def thinking_llama(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny llama with `<think>` and `</think>` as single tokens of its vocabulary (two of
    its reserved ids, as in Qwen3's and DeepSeek-R1's: added, not special), so the engine can
    watch for the end of a thinking. Same weights."""
    path = tmp_path_factory.mktemp("thinking") / "llama"
    shutil.copytree(tiny_llama, path)
    tokenizer_file = path / "tokenizer.json"
    state = json.loads(tokenizer_file.read_text())
    tags = {f"<|reserved_{i}|>": tag for i, tag in ((6, "<think>"), (7, "</think>"))}
    for token in state["added_tokens"]:
        if token["content"] in tags:
            token["content"], token["special"] = tags[token["content"]], False
    tokenizer_file.write_text(json.dumps(state))
    return str(path)


@pytest.fixture(scope="session")
def tiny_lora(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A seeded rank-8 LoRA adapter of `tiny_llama` over every projection (PEFT's format)."""
    from pagedray.workers.lora_checkpoint import make_lora_adapter

    return str(make_lora_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "a", rank=8))


@pytest.fixture
def exact_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CPU backend's exact rows for this test (`PAGEDRAY_EXACT_ATTENTION=1`, the default),
    whatever the environment says."""
    yield from _attention_setting(monkeypatch, "1")


@pytest.fixture
def attention_by_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CPU backend's kernels by path for this test (`PAGEDRAY_EXACT_ATTENTION=0`), whatever
    the environment says."""
    yield from _attention_setting(monkeypatch, "0")


def _attention_setting(monkeypatch: pytest.MonkeyPatch, value: str) -> Iterator[None]:
    from pagedray.attention import cpu_backend

    monkeypatch.setenv(cpu_backend.EXACT_ATTENTION_ENV, value)
    cpu_backend.exact_rows.cache_clear()  # the backend reads the setting once
    yield
    monkeypatch.undo()
    cpu_backend.exact_rows.cache_clear()


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' own greedy `generate` for a checkpoint (EOS off: fixed-length outputs),
    memoized per (path, prompts, max_new_tokens): the reference our engine must equal."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple, list[list[int]]] = {}

    def generate(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        key = (path, tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None
            outputs = []
            with torch.inference_mode():
                for prompt in prompts:
                    ids = torch.tensor([prompt])
                    out = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        pad_token_id=0,
                    )
                    outputs.append(out[0, len(prompt) :].tolist())
            cache[key] = outputs
        return cache[key]

    return generate


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session; shut down at the end so nothing is left running."""
    import ray

    # NOTE: logical CPUs, not cores: each engine reserves a bundle for itself and one per TP rank.
    ray.init(
        address="local",  # never attach to a cluster some other process left running
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # Serve was never started
        pass
    ray.shutdown()
