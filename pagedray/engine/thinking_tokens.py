"""Where a reasoning model's thinking ends, in tokens: a structured output's grammar holds only
after it, as vLLM's does (its `enable_in_reasoning` off), so the model thinks freely first, and
a `thinking_token_budget` counts the tokens before it.

Reasoning models' vocabularies have `<think>` and `</think>` as single tokens; the engine
watches a constrained sequence's output for the `</think>` id and applies the grammar from the
token after it. A prompt whose last tag is a `</think>` (Qwen3's template with thinking off, a
prefill that closed it) leaves nothing to wait for: the grammar holds from the first token, as
vLLM's `is_reasoning_end(prompt)` decides. A vocabulary without the tags (the toy default
model's) has no token to watch: there the grammar holds from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pagedray.scheduler.request_failure import refusal

THINK_START = "<think>"
THINK_END = "</think>"
# Where a turn starts, for the parsers whose prompts are read only back to it: Qwen3's template
# keeps the thinking of the assistant turns since the last user message (a tool-call loop),
# and a new turn thinks anew, so vLLM's Qwen3 parser stops at these.
TURN_BOUNDARIES = {"qwen3": ("<|im_start|>", "<|im_end|>")}
UNKEPT_BUDGET = "needs a reasoning parser and a vocabulary where </think> is one token"


@dataclass(frozen=True)
class ThinkingTokens:
    """The ids of a vocabulary's thinking tags, and of the turn boundaries a prompt is read
    back to (none: the whole prompt)."""

    start: int | None  # `<think>`, where it is one token
    end: int  # `</think>`
    boundaries: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Any, parser: str | None) -> ThinkingTokens | None:
        """The tags' ids, and the turn boundaries of `parser` (`--reasoning-parser`); None
        without a parser, or where `</think>` is not one token of the vocabulary: then nothing
        in the engine watches a thinking."""
        end = single_token_id(tokenizer, THINK_END) if parser is not None else None
        if end is None:
            return None
        boundaries = (single_token_id(tokenizer, b) for b in TURN_BOUNDARIES.get(parser or "", ()))
        return cls(
            single_token_id(tokenizer, THINK_START),
            end,
            frozenset(b for b in boundaries if b is not None),
        )

    def thinking_end(self, prompt_token_ids: Sequence[int]) -> int | None:
        """The token that ends the thinking an output of this prompt starts in (its grammar
        holds after it, its thinking budget counts before it): `</think>`, unless the prompt's
        thinking is closed already (its turn's last tag is a `</think>`); then None."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.start or token_id in self.boundaries:
                return self.end
            if token_id == self.end:
                return None
        return self.end


def check_budget(thinking: ThinkingTokens | None, budget: int | None) -> None:
    """Refuse a `thinking_token_budget` that cannot be kept: no thinking tokens to watch."""
    if budget is not None and thinking is None:
        raise refusal("thinking_token_budget", UNKEPT_BUDGET)


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """`text`'s id where it is one token of the vocabulary: an added token, or what it encodes
    to alone (a SentencePiece vocabulary may spell it with a word-start mark)."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
        return token_id
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
