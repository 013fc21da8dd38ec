"""A reasoning model's thinking apart from its answer (vLLM's `--reasoning-parser`): what the
model writes between `<think>` and `</think>` becomes the chat message's `reasoning` (vLLM's
field), the rest its `content`, whole or streamed, so clients show one and use the other.

Two parsers, for the thinking models this server runs:
- `deepseek_r1` (DeepSeek-R1 and its Llama and Qwen distillations): the template opens the
  thinking itself, so the output may start inside it without a `<think>`; everything up to
  `</think>` is reasoning, and an output that never closes it (cut short) is all reasoning.
- `qwen3`: the same, unless the request turned thinking off (`chat_template_kwargs:
  {"enable_thinking": false}`: then it is all content); a `<tool_call>` also ends the thinking,
  so the tool parser still finds the call.
- `deepseek_v3` (DeepSeek-V3.1 and later, whose thinking is a mode): `deepseek_r1`'s rules
  where the request turned thinking on (`chat_template_kwargs: {"thinking": true}`, or
  `enable_thinking`), else all content, as vLLM's.
As vLLM, the prompt decides where the output starts: after a prompt whose thinking is closed
already (a prefill that closed it, Qwen3's template with thinking off) it starts in the content,
and so does the continuation of a prefill that opened none (Anthropic's prefill, `{` for JSON);
and so does output a regex, choice or grammar holds from its first token, which enters the
thinking only on a leading `<think>`. But as vLLM's, a structured output's grammar holds only
after the thinking, where `</think>` is one token of the vocabulary (as it is in reasoning
models'): the model thinks freely, and the engine applies the grammar from the token after it
(engine/thinking_tokens.py).
The text is split as it arrives; a tag split across two pieces is held until it is whole, so a
stream's pieces join into exactly the whole answer's `reasoning` and `content`. Tool calls are
read from the content only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pagedray.engine.thinking_tokens import (
    THINK_END,
    THINK_START,
    TURN_BOUNDARIES,
    single_token_id,
)

TOOL_CALL_START = "<tool_call>"


@dataclass(frozen=True)
class ReasoningParser:
    """How one request's output splits: whether it starts in the thinking, and what ends it."""

    thinking: bool  # whether the output starts inside the thinking (else: on a leading tag)
    ends: tuple[str, ...]  # what ends it: dropped (`</think>`) or kept as content (a tool call)
    shown: bool = True  # False: the reasoning is split off and dropped (vLLM's include_reasoning)

    @classmethod
    def of(
        cls,
        name: str | None,
        template_kwargs: Mapping[str, Any],
        prompt_tail: str = "",
        constrained: bool = False,
        shown: bool = True,
        continues: bool = False,
    ) -> ReasoningParser | None:
        """The parser `name` (`--reasoning-parser`) for a request rendered with these template
        variables, whose prompt ends with `prompt_tail`, its output held by a grammar from the
        first token or not, continuing the final message it was given (a prefill) or not; None
        without one, or with Qwen3's thinking turned off."""
        if name is None:
            return None
        if not continues:  # the prompt is read back to its turn's start, where it has one
            cut = max((prompt_tail.rfind(b) for b in TURN_BOUNDARIES.get(name, ())), default=-1)
            prompt_tail = prompt_tail[cut + 1 :] if cut >= 0 else prompt_tail
        start, end = prompt_tail.rfind(THINK_START), prompt_tail.rfind(THINK_END)
        if continues:  # a prefill continues inside the thinking only if it opened one
            starts_inside = start > end and not constrained
        else:
            starts_inside = not (end > start or constrained)
        if name == "qwen3":
            if template_kwargs.get("enable_thinking", True) is False:
                return None  # all content, as vLLM's
            return cls(starts_inside, (THINK_END, TOOL_CALL_START), shown)
        if name == "deepseek_v3" and not (
            template_kwargs.get("thinking") or template_kwargs.get("enable_thinking")
        ):
            return None  # thinking is off unless asked for: all content, as vLLM's
        if name in ("deepseek_r1", "deepseek_v3"):
            return cls(starts_inside, (THINK_END,), shown)
        raise ValueError(f"reasoning_parser: unknown {name!r}")

    def counter(self, tag_ids: Mapping[str, int]) -> ThoughtCounter:
        """A counter of one choice's thinking in tokens, given the ids of the tags that are
        single tokens of the vocabulary (`tag_ids`, with `</think>`'s at least)."""
        ends = frozenset(tag_ids[end] for end in self.ends if end in tag_ids)
        return ThoughtCounter(self.thinking, tag_ids.get(THINK_START), ends)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        return self.stream().feed(text, finished=True)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One choice's output split as it arrives."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.thinking = parser.thinking
        self.opened = False  # some text has been read: a `<think>` past here is text
        self.held = ""  # the end of what arrived, which may be the start of a tag

    def feed(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of this piece of text; `finished`: its last piece."""
        reasoning, content = self._split(text, finished)
        return (reasoning if self.parser.shown else None), content

    def _split(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        text = self.held + text
        self.held = ""
        if not self.opened:
            if THINK_START.startswith(text) and not finished:
                self.held = text  # perhaps the opening tag, not whole yet
                return None, None
            if text.startswith(THINK_START):
                text, self.thinking = text[len(THINK_START) :], True
            self.opened = True
        if not self.thinking:
            return None, text or None
        found = [(text.find(end), end) for end in self.parser.ends if end in text]
        if found:
            position, end = min(found)
            self.thinking = False
            rest = text[position + len(end) :] if end == THINK_END else text[position:]
            return text[:position] or None, rest or None
        if not finished:
            keep = _tag_prefix_length(text, self.parser.ends)
            self.held, text = text[len(text) - keep :], text[: len(text) - keep]
        return text or None, None


@dataclass
class ThoughtCounter:
    """One choice's thinking counted in tokens as they arrive (vLLM's usage
    `reasoning_tokens`): the tokens between the start (or a leading `<think>`) and what ends
    the thinking, tags excluded."""

    thinking: bool
    start: int | None  # `<think>`'s id
    ends: frozenset[int]
    opened: bool = False
    count: int = 0

    def add(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            if not self.opened:
                self.opened = True
                if token_id == self.start:
                    self.thinking = True
                    continue
            if not self.thinking or token_id in self.ends:
                self.thinking = False
                return
            self.count += 1


def reasoning_tag_ids(tokenizer: Any) -> dict[str, int] | None:
    """The ids of the tags that are single tokens of the vocabulary; None without `</think>`
    (thinking is then not counted in tokens)."""
    ids = {
        tag: single_token_id(tokenizer, tag) for tag in (THINK_START, THINK_END, TOOL_CALL_START)
    }
    known = {tag: token_id for tag, token_id in ids.items() if token_id is not None}
    return known if THINK_END in known else None


def _tag_prefix_length(text: str, tags: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could begin one of `tags`."""
    for length in range(min(len(text), max(len(tag) for tag in tags) - 1), 0, -1):
        if any(tag.startswith(text[-length:]) for tag in tags):
            return length
    return 0
