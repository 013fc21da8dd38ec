"""Structured outputs on the worker: the scheduler's bitmask applied to a step's logits.

Disallowed tokens go to -inf before any sampling parameter is applied, so greedy, temperature,
top-k/p, penalties and logit_bias all pick among the tokens the grammar allows (as vLLM V1 masks
in the model runner), and logprobs are those of the constrained distribution. On the CPU one C
call masks every row (attention/csrc/layer_ops_cpu.c: torch's masked_fill over a batch of
vocabularies took ten times as long); elsewhere torch does it.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from pagedray.attention import cpu_kernels
from pagedray.attention.cpu_kernels import CFunction
from pagedray.scheduler.messages import GrammarBitmask

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def apply_grammar_bitmask(
    logits: torch.Tensor, sample_req_ids: list[str], bitmask: GrammarBitmask
) -> None:
    """Masks, in place, the rows of `logits` whose request has a bitmask row.

    Args:
        logits: [num_samples, vocab_size] float32, one row per entry of `sample_req_ids`.
        sample_req_ids: the request of each logits row.
        bitmask: allowed tokens per constrained request; ids past its rows are disallowed.
    """
    row_of = {req_id: i for i, req_id in enumerate(sample_req_ids)}
    mask_rows = [j for j, req_id in enumerate(bitmask.req_ids) if req_id in row_of]
    if not mask_rows:
        return
    words = np.frombuffer(bitmask.data, dtype="<i4").reshape(-1, bitmask.words_per_row)
    words = words[mask_rows] if len(mask_rows) < len(bitmask.req_ids) else words
    rows = [row_of[bitmask.req_ids[j]] for j in mask_rows]
    apply_c = _c_entry()
    if apply_c is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        assert logits.stride(1) == 1
        words = np.ascontiguousarray(words)
        row_index = np.asarray(rows, dtype=np.int64)
        apply_c(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[1],
            words.ctypes.data,
            bitmask.words_per_row,
            row_index.ctypes.data,
            len(rows),
        )
        return
    _apply_torch(logits, rows, words)


def _apply_torch(logits: torch.Tensor, rows: list[int], words: np.ndarray) -> None:
    # [num_masked, words_per_row * 32]: bit i of the row is token id i
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    vocab_size = logits.shape[1]
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    width = min(vocab_size, bits.shape[1])
    allowed[:, :width] = torch.from_numpy(bits[:, :width]).view(torch.bool)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)  # [num_masked, vocab_size]
    masked.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, masked)


@functools.cache
def _c_entry() -> CFunction | None:
    if not cpu_kernels.available():
        return None
    fn = cpu_kernels.library().apply_token_bitmask_f32
    fn.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64]
    fn.restype = None
    return fn
