"""One choice's text as its tokens arrive: incremental detokenization, stop strings, and the
part of the text that is safe to stream.

Used where text is made: by the offline `LLM`'s output processor, and by the serving ingress,
which receives token ids from the engine (`request_text.py`). The engine replica itself never
decodes.
"""

from __future__ import annotations

from typing import Any

from pagedray.engine.detokenizer import IncrementalDetokenizer
from pagedray.scheduler.sampling_params import SamplingParams


class ChoiceText:
    """The text of one choice and how far it has been streamed."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream_text: bool = True,
    ) -> None:
        """`stream_text=False`: text is decoded once, when the choice ends, unless stop strings
        must be searched as tokens arrive."""
        self.params = params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.decode_as_tokens_arrive = stream_text or bool(params.stop)
        self.text = ""
        self.num_streamed_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # The longest text a stop string could still be completing: never streamed early.
        self._hold = max((len(stop) for stop in params.stop), default=1) - 1

    def push(self, token_ids: list[int]) -> bool:
        """Add tokens; returns True when a stop string ended the choice (the engine must stop
        generating it). Callers with stop strings push one token at a time, so that no token
        after the stop string is counted."""
        if not self.decode_as_tokens_arrive:
            self.detokenizer.append(token_ids)
            return False
        new_text = self.detokenizer.push(token_ids)
        if self.params.stop and self._find_stop_string(new_text):
            return True
        self.text += new_text
        return False

    def finish(self, finish_reason: str, stop_token_id: int | None) -> None:
        """The engine ended the choice: the exact final text, less a stop token's text.

        `stop_token_id` is the last token when it was EOS or a stop token (finish "stop")."""
        self.finish_reason = finish_reason
        if stop_token_id is not None and stop_token_id in self.params.stop_token_ids:
            self.stop_reason = stop_token_id
        drop = 1 if stop_token_id is not None and not self.params.include_stop_str_in_output else 0
        self.text = self.detokenizer.full_text(drop_last=drop)

    def take_new_text(self) -> str:
        """The text not streamed yet, less a possible stop string's prefix until it is decided."""
        hold = 0 if self.finish_reason else self._hold
        end = max(self.num_streamed_chars, len(self.text) - hold)
        text = self.text[self.num_streamed_chars : end]
        self.num_streamed_chars = end
        return text

    def _find_stop_string(self, new_text: str) -> bool:
        stops = self.params.stop
        # A stop string may span tokens: search from just before the new text.
        start = max(0, len(self.text) - max(len(s) for s in stops) + 1)
        text = self.text + new_text
        hits = [(pos, s) for s in stops if (pos := text.find(s, start)) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        keep = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.text = text[:keep]
        self.finish_reason = "stop"
        self.stop_reason = stop
        return True
