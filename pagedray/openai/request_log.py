"""The request log, as vLLM's `--enable-log-requests`, `--enable-log-outputs` and `--max-log-len`
write it: its lines in its words, so a server moved from vLLM logs what it did (less vLLM's
`lora_request`, which has no meaning here, and with a streamed choice's real finish reason
where vLLM writes `streaming_complete`).

Prompts and outputs are the users' data: nothing is logged unless asked. With
`--enable-log-requests`, each engine request's id and sampling parameters at INFO, its prompt
(text and token ids) only at DEBUG. With `--enable-log-outputs` too, each choice's text and finish
reason when it ends, and each streamed delta's text unless `--no-enable-log-deltas`; token ids
only at DEBUG. `--max-log-len N` cuts every logged text to N characters and id list to N ids.
The text logged is what the model generated, as the client's text is made from it (tool calls
in their markup), for every API the server speaks.
"""

from __future__ import annotations

import logging
from typing import Any

from pagedray.engine.config import EngineConfig
from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.prompt_validator import ValidatedPrompt
from pagedray.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def warn_if_unseen(config: EngineConfig) -> None:
    """At a server's start: request logging asked for, but INFO not logged (vLLM warns too)."""
    if config.enable_log_requests and not logger.isEnabledFor(logging.INFO):
        logger.warning(
            "--enable-log-requests is set but the log level is above INFO: no request is logged"
        )


class RequestLog:
    """What one client request (its engine requests, one per prompt) writes to the request
    log; made only when the server logs requests."""

    def __init__(self, config: EngineConfig, stream: bool) -> None:
        self.max_len = config.max_log_len
        self.outputs = config.enable_log_outputs
        self.deltas = config.enable_log_deltas and stream
        self.stream = stream
        self.token_ids: dict[tuple[str, int], list[int]] = {}  # per choice, at DEBUG
        self.shown: dict[str, str] = {}  # an engine request's id -> the id its lines show

    def received(
        self,
        request_id: str,
        prompt: ValidatedPrompt,
        params: SamplingParams,
        shown_as: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """An engine request's line; `shown_as`: the id its lines show (the client's, without
        the engine's suffix), else its own; `lora_name`: its LoRA adapter, as vLLM shows it."""
        if shown_as is not None:
            self.shown[request_id] = request_id = shown_as
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s.",
                request_id,
                self._cut(prompt.text),
                self._cut(prompt.token_ids),
            )
        if lora_name is None:
            logger.info("Received request %s: params: %s.", request_id, params)
        else:
            logger.info(
                "Received request %s: params: %s, lora_request: %s.", request_id, params, lora_name
            )

    def output(self, delta: ChoiceDelta, choice_text: str) -> None:
        """A choice's delta, as the client gets it (`delta.text`), and the choice's whole text
        so far: the delta logged when streamed deltas are, the whole when the choice ends."""
        if not self.outputs:
            return
        debug = logger.isEnabledFor(logging.DEBUG)
        key = (delta.request_id, delta.index)
        if debug:
            self.token_ids.setdefault(key, []).extend(delta.token_ids)
        if self.deltas and delta.text:
            self._log(delta, " (streaming delta)", delta.text, delta.token_ids)
        if delta.finish_reason is not None:
            kind = " (streaming complete)" if self.stream else ""
            self._log(delta, kind, choice_text, self.token_ids.pop(key, []))

    def _log(self, delta: ChoiceDelta, kind: str, text: str, token_ids: list[int]) -> None:
        request_id = self.shown.get(delta.request_id, delta.request_id)
        if logger.isEnabledFor(logging.DEBUG):
            ids = self._cut(token_ids)
            logger.debug(
                "Generated response %s%s details: output_token_ids: %s", request_id, kind, ids
            )
        logger.info(
            "Generated response %s%s: output: %r, finish_reason: %s",
            request_id,
            kind,
            self._cut(text),
            delta.finish_reason,
        )

    def _cut(self, value: Any) -> Any:
        if value is None or self.max_len is None:
            return value
        return value[: self.max_len]
