"""Grammar state of constrained requests: one llguidance matcher per sequence, and each step's
token bitmask for the rows that sample.

As vLLM V1 does, the scheduler owns the matchers: it ships a bitmask with the plan, the worker
masks the logits before sampling, and the scheduler advances each matcher with the token that
came back. A matcher is built on a compile thread, never on the step loop; until it is ready its
request waits (it is skipped, not blocking the queue). Equal constraints share one compiled
template, copied per sequence, so a schema is compiled once. A matcher follows the sequence's
output tokens, which preemption keeps, so a recomputed sequence resumes where it was; a forked
(n > 1) sequence gets its own copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from pagedray.scheduler.messages import GrammarBitmask
from pagedray.scheduler.request_failure import FailureKind, RequestFailure, refusal
from pagedray.scheduler.structured_outputs import StructuredOutputsParams, compiled_grammar

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

# Compiled templates kept for reuse: a service usually sees a handful of schemas again and again.
# A very large spec is compiled each time rather than kept (a template's size is not known).
MAX_CACHED_GRAMMARS = 256
MAX_CACHED_SPEC_CHARS = 64 * 1024
# What a client is told when the grammar refused a token sampled under its own mask: a bug.
GRAMMAR_REJECTED = RequestFailure(
    FailureKind.INTERNAL, "structured output failed for this request (internal error)"
)

logger = logging.getLogger(__name__)
# From this many rows, on a machine with cores to spare, a step's masks are filled on
# llguidance's thread pool; else one after another on the step's thread, which is faster for a
# few rows (24 rows of a JSON schema on 2 cores: 55 us, against 206 us through the pool).
PARALLEL_MASK_ROWS = 128
PARALLEL_MASK_MIN_CPUS = 8


class RequestGrammar:
    """One sequence's matcher, ready once its compile finished (or failed with a message).

    A reasoning model's output holds to its grammar only after its thinking, as vLLM's does (its
    `enable_in_reasoning` off): the grammar opens after the token that ends the thinking
    (`</think>`), and until then neither masks the sequence's tokens nor reads them."""

    def __init__(self, future: Future[LLMatcher], opens_after: int | None = None) -> None:
        self._future = future
        self.matcher: LLMatcher | None = None
        self.error: str | None = None
        self.opens_after = opens_after  # None: the grammar holds (from the first token)

    @classmethod
    def of(cls, matcher: LLMatcher, opens_after: int | None = None) -> RequestGrammar:
        future: Future[LLMatcher] = Future()
        future.set_result(matcher)
        grammar = cls(future, opens_after)
        grammar.ready()
        return grammar

    @property
    def holds(self) -> bool:
        """The grammar constrains this sequence's next token (its thinking, if any, is over)."""
        return self.opens_after is None

    def ready(self) -> bool:
        """True once compiled (check `error`); never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        exc = self._future.exception()
        if exc is None:
            self.matcher = self._future.result()
        else:
            self.error = str(exc)
        return True

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for the compile (the step thread idles on it, not spins)."""
        with contextlib.suppress(FutureTimeoutError):
            self._future.exception(timeout=timeout_s)

    def fork(self) -> RequestGrammar:
        """A copy that advances on its own (a forked sequence from the same prompt)."""
        assert self.matcher is not None
        return RequestGrammar.of(self.matcher.deep_copy(), self.opens_after)

    def accept(self, token_ids: list[int]) -> bool:
        """Advance by sampled tokens; False if the grammar rejects one (the request must end).
        Tokens up to the one it opens after are the thinking's, not the grammar's."""
        assert self.matcher is not None
        if self.opens_after is not None:
            if self.opens_after not in token_ids:
                return True
            token_ids = token_ids[token_ids.index(self.opens_after) + 1 :]
            self.opens_after = None
        if not token_ids or self.matcher.consume_tokens(token_ids):
            return True
        # NOTE: llguidance's message is its reason on the first line, then the parser's state and
        # the whole grammar (some 20 lines): the reason is the error, the rest is for debugging.
        reason, _, state = self.matcher.get_error().partition("\n")
        logger.error("grammar rejected sampled tokens %s: %s", token_ids, reason)
        logger.debug("grammar state at the rejection: %s", state)
        return False

    def cancel(self) -> None:
        """The sequence ended: drop its compile if it has not started."""
        self._future.cancel()

    @property
    def terminated(self) -> bool:
        """The output is complete: the grammar allows nothing more (but end of sequence)."""
        return self.holds and self.matcher is not None and self.matcher.is_stopped()


@dataclass
class GrammarStats:
    """Counters for metrics: drained by `take_compile_times`, read at every step."""

    num_compiled: int = 0
    num_cache_hits: int = 0
    last_mask_s: float = 0.0  # bitmask time of the last step that had constrained rows


class StructuredOutputManager:
    """Compiles constraints against the model's tokenizer and fills each step's bitmask."""

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        """`tokenizer_json`: gives the HF tokenizers serialization, read by `prepare` (servers)
        or else at the first compile (a 150,000-token vocabulary takes about 0.8 s to index);
        `vocab_size`: the logits' width, which may exceed the tokenizer's (padded embeddings):
        extra ids are never allowed."""
        from llguidance import LLExecutor

        self._tokenizer_json = tokenizer_json
        self._tokenizer: LLTokenizer | None = None  # built on the compile thread
        # Why it could not be built, kept: a tokenizer that failed once fails again, and each
        # structured request would read and index it anew on the one compile thread.
        self._tokenizer_error: BaseException | None = None
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.words_per_row = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._executor = LLExecutor()
        self._parallel = (os.cpu_count() or 1) >= PARALLEL_MASK_MIN_CPUS
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedray-grammar")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedray-mask")
        self._templates: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._compile_times: list[float] = []  # seconds, per new template, until drained
        # The compile thread adds templates and times; the engine's thread copies templates and
        # the metrics drain the times.
        self._lock = threading.Lock()
        self.stats = GrammarStats()

    def start(
        self, params: StructuredOutputsParams, opens_after: int | None = None
    ) -> RequestGrammar:
        """A request's matcher: a copy of the cached template at once (microseconds), else
        built on the compile thread; `opens_after`: the token that ends the output's thinking,
        after which the grammar holds (None: from the first token)."""
        with self._lock:
            template = self._templates.get(params.key)
            if template is not None:
                self._templates.move_to_end(params.key)
                self.stats.num_cache_hits += 1
                return RequestGrammar.of(template.deep_copy(), opens_after)
        return RequestGrammar(self._compile_pool.submit(self._matcher, params.key), opens_after)

    def prepare(self) -> None:
        """Read the tokenizer and index its vocabulary now, before the first structured request
        needs it, and wait for it: llguidance holds the GIL while it indexes (0.8 s for a
        150,000-token vocabulary), so an index built beside a serving engine stalls its steps and
        its health checks. For servers (a replica starts that much later, whether or not a
        structured request comes); offline, the first structured request builds it. A tokenizer
        it cannot index leaves structured requests to be refused with the reason."""
        try:
            self._compile_pool.submit(self._llg_tokenizer).result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException too
            logger.warning("structured outputs unavailable: %s", exc)

    def _llg_tokenizer(self) -> LLTokenizer:
        """On the compile thread: the vocabulary as llguidance indexes it, built once; a
        failure is kept and raised again."""
        if self._tokenizer_error is not None:
            raise self._tokenizer_error.with_traceback(None)  # its traceback grows no longer
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            try:
                self._tokenizer = LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - kept for the next compile
                self._tokenizer_error = exc
                raise
        return self._tokenizer

    def _matcher(self, key: tuple[str, str]) -> LLMatcher:
        """On the compile thread: the template for `key` (compiled unless an earlier request
        of the same constraint compiled it meanwhile), copied."""
        from llguidance import LLMatcher

        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self.stats.num_cache_hits += 1
                return template.deep_copy()
        start = time.perf_counter()
        template = LLMatcher(self._llg_tokenizer(), compiled_grammar(key), log_level=0)
        if template.is_error():
            raise refusal(f"structured_outputs.{key[0]}", f"{template.get_error()}")
        with self._lock:
            self._compile_times.append(time.perf_counter() - start)
            self.stats.num_compiled += 1
            if len(key[1]) <= MAX_CACHED_SPEC_CHARS:
                self._templates[key] = template
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
            return template.deep_copy()

    def bitmask(
        self, grammars: dict[str, RequestGrammar], forced: dict[str, int] | None = None
    ) -> GrammarBitmask:
        """A row per sequence: the tokens its grammar allows next, computed in parallel with
        the GIL released; then a row per `forced` sequence that allows its one token."""
        import numpy as np

        forced = forced or {}
        start = time.perf_counter()
        rows = np.full((len(grammars) + len(forced), self.words_per_row), -1, dtype=np.int32)
        bits = rows.view(np.uint32)
        for i, token_id in enumerate(forced.values(), start=len(grammars)):
            bits[i] = 0
            bits[i, token_id // 32] = 1 << (token_id % 32)
        row_bytes = self.words_per_row * 4
        if len(grammars) >= PARALLEL_MASK_ROWS and self._parallel:
            matchers: list[tuple[Any, int]] = []
            for i, grammar in enumerate(grammars.values()):
                assert grammar.matcher is not None
                matchers.append((grammar.matcher, i))
            self._executor.unsafe_compute_mask_ptr(
                matchers, rows.ctypes.data, row_bytes, len(grammars)
            )
        else:
            for i, grammar in enumerate(grammars.values()):
                assert grammar.matcher is not None
                grammar.matcher.unsafe_compute_mask_ptr(rows.ctypes.data + i * row_bytes, row_bytes)
        self.stats.last_mask_s = time.perf_counter() - start
        return GrammarBitmask([*grammars, *forced], self.words_per_row, rows.tobytes())

    def end_token(self, grammar: RequestGrammar) -> int | None:
        """The EOS token that ends a complete output (nothing else could be sampled); None
        while the grammar allows more, or for a model without EOS (it is then sampled)."""
        if not grammar.terminated or not self.eos_token_ids:
            return None
        return self.eos_token_ids[0]

    def bitmask_future(
        self, grammars: dict[str, RequestGrammar], forced: dict[str, int] | None = None
    ) -> Future[GrammarBitmask]:
        """`bitmask`, filled on the mask thread while the caller goes on (the forward pass);
        the caller must wait for it before advancing any of these matchers."""
        return self._mask_pool.submit(self.bitmask, grammars, forced)

    def take_compile_times(self) -> list[float]:
        with self._lock:
            times, self._compile_times = self._compile_times, []
        return times

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
