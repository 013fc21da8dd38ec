"""The model runner's kept float32 logits buffer (workers/model_runner.py `_logits_out`): a bf16
model's sampled logits go into one buffer reused step after step instead of a fresh tensor each
step. It must change no output: steps that sample more rows than the buffer holds (it grows),
fewer (a slice), beside prompt logprobs computed in the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedray import LLM, SamplingParams
from pagedray.tools.default_model import make_model
from pagedray.workers.model_runner import ModelRunner


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("bf16") / "m", arch="qwen2", dtype="bfloat16")


def _run(path: Path) -> list[tuple[list[int], list, list]]:
    llm = LLM(str(path), num_kv_blocks=64, enable_prefix_caching=False)
    try:
        # Arrivals of different sizes: steps sample 1, 3 and 6 rows, and prompts ask for their
        # logprobs, so the buffer grows, is sliced, and serves both uses within one step.
        outputs = []
        for batch in ([5], [7, 9, 11], [4, 6, 8, 10, 12, 14]):
            prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in batch]
            params = SamplingParams(
                temperature=0.8, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2, n=1
            )
            for out in llm.generate(prompts, params, use_tqdm=False):
                choice = out.outputs[0]
                outputs.append((choice.token_ids, choice.logprobs, out.prompt_logprobs))
        return outputs
    finally:
        llm.shutdown()


def test_the_kept_buffer_changes_no_output(
    bf16_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = _run(bf16_model)
    used = []  # every buffer handed out, held, so that no address is reused for another
    original = ModelRunner._logits_out

    def recording(self: ModelRunner, rows: int):  # type: ignore[no-untyped-def]
        buffer = original(self, rows)
        used.append(buffer)
        return buffer

    monkeypatch.setattr(ModelRunner, "_logits_out", recording)
    assert _run(bf16_model) == kept
    assert used and all(b is not None for b in used)  # a bf16 head: every step's went through it
    storages = [b.untyped_storage().data_ptr() for b in used]
    # Kept across steps, made anew only when a step sampled more rows than ever before.
    assert len(set(storages)) == len(
        {max(b.shape[0] for b in used[: i + 1]) for i in range(len(used))}
    )
    monkeypatch.setattr(ModelRunner, "_logits_out", lambda self, rows: None)
    assert _run(bf16_model) == kept  # each step's logits a fresh tensor, as before
