"""Top-k and top-p (nucleus) filtering of a batch's logits, without sorting whole vocabularies.

The plain way sorts every row: on a CPU, torch's sort of 64 rows takes 19 ms at a 4k vocabulary,
165 ms at 32k and 735 ms at 128k, longer than the model's step. Here each row's best 256 tokens
are selected first (`torch.topk`), then its best 4,096 where the vocabulary is large. That settles
a row whenever its kept set lies among them: a top_k up to that many, or a nucleus that reaches
top_p within them, the usual case for a trained model's peaked distribution. Only the other rows
(a flat distribution's wide nucleus, a top_k past the candidates) are sorted whole, after the
selections they did not settle in (25-40% more than sorting at once).

Both paths keep the same tokens (up to the order among equal logits, which neither defines):
a row's top_k, then the smallest prefix of those, by probability under the top-k distribution,
whose mass reaches top_p. The top token always stays.
"""

from __future__ import annotations

import torch

# Tokens selected per row, in rounds, before a row is sorted whole: most rows settle among the
# first; a round is skipped where it would select half the vocabulary (about a sort's cost).
CANDIDATE_WIDTHS = (256, 4096)
CANDIDATES = CANDIDATE_WIDTHS[0]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keeps each row's top_k tokens, then the smallest set whose probability reaches top_p.

    Args:
        logits: [num_rows, vocab_size] float32, already divided by temperature.
        top_k: [num_rows] int64, 0 = off (a value past the vocabulary is off too).
        top_p: [num_rows] float32 in (0, 1], 1 = off.
    Returns:
        [num_rows, vocab_size] logits with dropped tokens at -inf (a new tensor; rows with
        neither filter as they were).
    """
    return apply_top_k_top_p_(logits.clone(), top_k, top_p)


def apply_top_k_top_p_(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`apply_top_k_top_p` in place: each row is rewritten once it is settled, so a batch of
    a large vocabulary costs no fresh copy of it (at 64 rows of 152k tokens each cost 12 ms in
    page faults). Returns `logits`."""
    vocab_size = logits.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)  # [num_rows]
    pending = (k < vocab_size) | (top_p < 1.0)  # [num_rows]: rows still to filter
    row_lse: torch.Tensor | None = None  # [num_rows]: each whole row's logsumexp, once
    for width in CANDIDATE_WIDTHS:
        if 2 * width > vocab_size or not bool(pending.any()):
            break
        rows = pending.nonzero().squeeze(1)  # [num_pending]
        pending_logits = logits if len(rows) == len(logits) else logits[rows]
        if row_lse is None:
            row_lse = _whole_row_lse(logits, pending & (k == vocab_size))
        values, token_ids, settled = _among_candidates(
            pending_logits, k[rows], top_p[rows], width, row_lse[rows]
        )
        settled_rows = rows[settled]
        logits.index_fill_(0, settled_rows, float("-inf"))
        logits[settled_rows.unsqueeze(1), token_ids[settled]] = values[settled]
        pending[settled_rows] = False
    if bool(pending.any()):
        logits[pending] = apply_top_k_top_p_sorted(logits[pending], top_k[pending], top_p[pending])
    return logits


def _whole_row_lse(logits: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
    """[num_rows]: the logsumexp of each row `marked` [num_rows] bool marks (the normaliser of a
    row with top_p alone), NaN elsewhere."""
    lse = torch.full((len(logits),), float("nan"), device=logits.device)
    if bool(marked.any()):
        lse[marked] = (logits if bool(marked.all()) else logits[marked]).logsumexp(dim=-1)
    return lse


def _among_candidates(
    logits: torch.Tensor,
    k: torch.Tensor,
    top_p: torch.Tensor,
    width: int,
    row_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Filters each row among its best `width` tokens; returns their values (-inf where
    dropped) and ids, and which rows are settled (their kept set lies among the candidates;
    the others are to be redone). Reads `logits`, writes nothing.

    Args:
        logits: [num_rows, vocab_size]; k: [num_rows], the vocabulary size where top_k is off;
        top_p: [num_rows]; row_lse: [num_rows], `_whole_row_lse` where known.
    Returns:
        values [num_rows, width], token_ids [num_rows, width], settled [num_rows].
    """
    vocab_size = logits.shape[1]
    values, token_ids = logits.topk(width, dim=-1)  # [num_rows, width], best first
    positions = torch.arange(width, device=logits.device).unsqueeze(0)  # [1, width]
    kept = positions < k.unsqueeze(1)  # [num_rows, width]
    # The top-k distribution's normaliser: its k candidates, or the whole row where top_k is
    # off (a k between the two is not settled here, so its normaliser does not matter).
    within = values.masked_fill(~kept, float("-inf")).logsumexp(dim=-1)  # [num_rows]
    whole = k == vocab_size  # [num_rows]: rows with top_p alone
    if row_lse is None:
        row_lse = _whole_row_lse(logits, whole)
    normaliser = torch.where(whole, row_lse, within)  # [num_rows]
    probs = (values - normaliser.unsqueeze(1)).exp().masked_fill(~kept, 0.0)  # [num_rows, width]
    drop = _past_nucleus(probs, top_p)
    kept &= ~drop
    # mass_before only grows, so a dropped last candidate means every later token is dropped.
    settled = (k <= width) | (drop[:, -1] & (k == vocab_size))  # [num_rows]
    return values.masked_fill(~kept, float("-inf")), token_ids, settled


def apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`apply_top_k_top_p` by sorting each row whole (the rows the candidates do not settle)."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [num_rows, vocab_size]
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, vocab_size]
    k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)  # [num_rows, 1]
    sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
    drop = _past_nucleus(sorted_logits.softmax(dim=-1), top_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _past_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[num_rows, n] bool: the tokens top_p drops from best-first probabilities [num_rows, n].

    A token stays while the mass strictly before it is below top_p, so the top token always
    stays. Rows at top_p = 1 skip this: rounding could push the exclusive cumsum to 1.0.
    """
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    # NOTE: explicitly, as a top_p below float32's range (1e-300) is 0 here and would drop it.
    drop[:, 0] = False
    return drop
