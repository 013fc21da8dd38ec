"""Where a reasoning model's thinking ends, in tokens: a structured output's grammar holds only
after it, as vLLM's does (its `enable_in_reasoning` off), so the model thinks freely first.

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

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ThinkingTokens:
    """The ids of a vocabulary's thinking tags."""

    start: int | None  # `<think>`, where it is one token
    end: int  # `</think>`

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkingTokens | None:
        """The tags' ids; None where `</think>` is not one token of the vocabulary."""
        end = single_token_id(tokenizer, THINK_END)
        return None if end is None else cls(single_token_id(tokenizer, THINK_START), end)

    def grammar_after(self, prompt_token_ids: Sequence[int]) -> int | None:
        """The token after which an output of this prompt holds to its grammar: `</think>`,
        unless the prompt's thinking is closed already (its last tag is a `</think>`)."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.start:
                return self.end
            if token_id == self.end:
                return None
        return self.end


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """`text`'s id where it is one token of the vocabulary."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
