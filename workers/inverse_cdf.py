"""Drawing tokens from a batch's weights: one uniform number per draw, the cumulative sum inverted.

On a CPU `torch.multinomial` (and the exponential trick vLLM uses on GPUs) draws one random
number per vocabulary entry; inverting each row's cumulative weights needs one per draw.
"""

from __future__ import annotations

import torch


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> list[list[int]]:
    """Draws with replacement by inverting each row's cumulative weights at uniform points.

    One random number per draw, where `torch.multinomial` (and the exponential trick vLLM uses on
    GPUs) draws one per vocabulary entry on the CPU: at 64 rows of a 4k vocabulary 0.26 ms
    against 4.9 ms, at 32k 2.2 ms against 43 ms, on this project's CI machine. The cumulative
    sum is not renormalised, so unnormalised weights (zeros left by top-k, top-p, min-p or a
    grammar) work as they are, and a zero-weight token, a flat step of the sum, is never drawn.

    Args:
        weights: [rows, vocab_size] nonnegative, each row with a positive sum.
        uniform: [rows, draws] in [0, 1).
    Returns:
        [rows][draws] token ids.
    """
    cumulative = weights.cumsum(dim=-1)  # [rows, vocab_size]
    points = uniform.to(cumulative.dtype) * cumulative[:, -1:]  # [rows, draws]
    token_ids = torch.searchsorted(cumulative, points, right=True)  # [rows, draws]
    vocab_size = weights.shape[-1]
    if weights.device.type != "cpu":
        # A parallel scan (CUDA's) may step up by a rounding unit at a zero-weight token, or
        # even down: on a CPU the sum is sequential and adding 0 leaves it exactly as it was.
        return snap_to_weighted(weights, token_ids).tolist()
    if bool((token_ids >= vocab_size).any()):
        # Rounding put a point at the sum itself, past every token: it belongs to the last
        # token with any weight, where the sum last rises.
        last_drawable = vocab_size - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)  # [rows]
        token_ids = torch.minimum(token_ids, last_drawable.unsqueeze(1))
    return token_ids.tolist()


def snap_to_weighted(weights: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each drawn id moved back to the last token with weight at or before it (past the end:
    the last one with weight; before the first: the first), so a zero-weight token is never
    returned however the cumulative sum was rounded.

    Args:
        weights: [rows, vocab_size] nonnegative, each row with a positive weight.
        token_ids: [rows, draws] in [0, vocab_size].
    Returns:
        [rows, draws] ids of tokens with weight.
    """
    vocab_size = weights.shape[-1]
    weighted = weights > 0  # [rows, vocab_size]
    positions = torch.arange(vocab_size, device=weights.device).expand_as(weights)
    last_weighted = torch.where(weighted, positions, -1).cummax(dim=-1).values  # [rows, vocab]
    snapped = last_weighted.gather(1, token_ids.clamp(max=vocab_size - 1))  # [rows, draws]
    first_weighted = weighted.int().argmax(dim=-1, keepdim=True)  # [rows, 1]
    return torch.where(snapped >= 0, snapped, first_weighted)
