"""With the CPU backend's exact rows (the default; `PAGEDRAY_EXACT_ATTENTION=0` opts out), a
token's logits are the same bits however its context was computed — in one prefill, in chunks,
one decode step at a time, beside other requests, or read from the prefix cache — so a request
resumed on another engine, recomputed after preemption or batched with others draws the same
tokens, sampled ones included. Real engines on the tiny models, in-process; the CPU backend's
exact rows (attention/cpu_backend.py) and row-independent GEMMs make it so."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from exact_gemm import gemm_rows_do_not_depend_on_the_batch

from pagedray.attention import cpu_kernels, cpu_row_tiles
from pagedray.llm import LLM
from pagedray.scheduler.outputs import RequestOutput
from pagedray.scheduler.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.skipif(
        not cpu_kernels.available(), reason="the C kernels did not build here (no C compiler)"
    ),
    pytest.mark.usefixtures("exact_attention"),
]


MAX_TOKENS = 24
WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _chosen_logprobs(output: RequestOutput) -> list[float]:
    choice = output.outputs[0]
    assert choice.logprobs is not None
    return [step[token] for token, step in zip(choice.token_ids, choice.logprobs, strict=True)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    batch = [{"prompt_token_ids": p} for p in prompts]
    return llm.generate(batch, params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tokens_logprob_is_the_same_bits_by_every_path(
    tiny_models: dict[str, str], arch: str
) -> None:
    hidden = json.loads((Path(tiny_models[arch]) / "config.json").read_text())["hidden_size"]
    if not gemm_rows_do_not_depend_on_the_batch(hidden):
        pytest.skip("this CPU's GEMM rounds a row by the batch's size: outputs cannot be exact")
    llm = LLM(tiny_models[arch], dtype="float32", enable_prefix_caching=False)
    prompt = _prompt(1, 70)
    [alone] = _run(llm, [prompt], WITH_LOGPROBS)
    tokens, expected = alone.outputs[0].token_ids, _chosen_logprobs(alone)

    # Each token's logprob with its context computed as one prefill (as a resumed request's or a
    # preempted one's is), where the run above computed it one decode step at a time.
    for cut in (1, 5, 13, MAX_TOKENS - 1):
        single = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=1)
        [resumed] = _run(llm, [prompt + tokens[:cut]], single)
        assert resumed.outputs[0].token_ids == [tokens[cut]]
        assert _chosen_logprobs(resumed) == [expected[cut]], cut

    # Beside other requests, prompts and decodes of other lengths in the same steps.
    together = _run(llm, [_prompt(2, 33), prompt, _prompt(3, 150)], WITH_LOGPROBS)
    assert _chosen_logprobs(together[1]) == expected

    # The prompt in chunks of 16 tokens.
    chunked = LLM(
        tiny_models[arch], dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=16
    )
    assert _chosen_logprobs(_run(chunked, [prompt], WITH_LOGPROBS)[0]) == expected

    # Behind a prefix read from the cache: the prompt's blocks computed by a prefill, then the
    # blocks of its output by decode steps, which a later turn reads back.
    cached = LLM(tiny_models[arch], dtype="float32", enable_prefix_caching=True)
    assert _chosen_logprobs(_run(cached, [prompt], WITH_LOGPROBS)[0]) == expected
    cut = MAX_TOKENS - 1
    single = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=1)
    [next_turn] = _run(cached, [prompt + tokens[:cut]], single)
    assert next_turn.num_cached_tokens > len(prompt)  # decode-written blocks among them
    assert _chosen_logprobs(next_turn) == [expected[cut]]


def test_decodes_behind_a_shared_prefix_share_its_reads_and_keep_their_bits(
    tiny_models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests behind one cached prefix decode in tiles that read its blocks once for all of
    them (attention/cpu_row_tiles.py); each token's logprob is the bits it has alone."""
    hidden = json.loads((Path(tiny_models["llama"]) / "config.json").read_text())["hidden_size"]
    if not gemm_rows_do_not_depend_on_the_batch(hidden):
        pytest.skip("this CPU's GEMM rounds a row by the batch's size: outputs cannot be exact")
    prefix = _prompt(1, 70)  # four whole blocks of 16 tokens and a part
    prompts = [prefix + _prompt(10 + i, 3 + 7 * i) for i in range(5)]
    alone = LLM(tiny_models["llama"], dtype="float32", enable_prefix_caching=False)
    expected = [_chosen_logprobs(_run(alone, [p], WITH_LOGPROBS)[0]) for p in prompts]

    shared_tiles: list[tuple[int, int]] = []  # (decodes, blocks read once) of each shared tile
    planned = cpu_row_tiles._shared_prefix_groups

    def recorded(*args: object) -> list[tuple[list[int], int]]:
        groups = planned(*args)  # type: ignore[arg-type]
        shared_tiles.extend((len(members), blocks) for members, blocks in groups)
        return groups

    monkeypatch.setattr(cpu_row_tiles, "_shared_prefix_groups", recorded)
    cached = LLM(tiny_models["llama"], dtype="float32", enable_prefix_caching=True)
    _run(cached, [prefix], SamplingParams(max_tokens=1))  # the prefix's blocks, cached
    together = _run(cached, prompts, WITH_LOGPROBS)
    assert [_chosen_logprobs(out) for out in together] == expected
    # Tiles of several decodes read the prefix's four whole blocks once for all of them.
    assert any(decodes >= 2 and blocks == 4 for decodes, blocks in shared_tiles), shared_tiles
