"""The engine's steps, run back to back on the compute thread while the event loop has nothing to
give the engine between them.

Handing each step to the compute thread and its result back to the event loop costs two thread
wake-ups a step. On 2 CPU cores a served engine measured 0.7-0.9 ms (median) between one step's
end and the next one's start: the loop waking (0.2 ms), its bookkeeping (0.15 ms) and the compute
thread waking (0.3-0.5 ms, longer when the other core is busy), 5-7% of a run. The next plan
depends only on the scheduler's state, which a step leaves up to date, unless the loop has
something for it first: a new request, an abort, or a stop string the engine found in the text.
So while the loop has none, the compute thread plans the next step at once, and hands each
finished step to the loop, which turns it into outputs while the next one runs (as vLLM's engine
core keeps stepping while its front end handles the outputs).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.step_metrics import StepRecord
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.outputs import EngineCoreOutput

# Per step, how much of the slowest recent step's time `slowest_s` keeps: a long prefill still
# counts for a third of its time a thousand steps later.
SLOWEST_DECAY = 0.999


@dataclass
class FinishedStep:
    """A step's results, read from the engine on the compute thread as the step ended."""

    outputs: list[EngineCoreOutput]
    record: StepRecord | None  # None: the call ran no step (nothing was schedulable)
    stats: dict[str, Any]  # the engine's stats after it
    deltas: list[ChoiceDelta] = field(default_factory=list)  # once the output processor ran
    advanced: list[str] = field(default_factory=list)  # requests that got tokens, likewise


class StepRunner:
    """Runs an engine's steps on the compute thread. Shared with the event loop: `started` (set
    by both, read by the loop), `streaming` and `stopping` (set by the loop), `failure` (set by a
    hand-over), and what `may_go_on` reads; each a single read or write under the GIL. While a
    run goes on only the compute thread changes the engine."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.started: float | None = None  # time.monotonic() at the start of the running step
        # The slowest recent step's seconds (decaying), and the steps timed: what a step that
        # runs on far longer is judged against (`AsyncEngine.stalled`).
        self.slowest_s = 0.0
        self.num_timed_steps = 0
        self.streaming = True  # whether a request in flight streams (workers/cpu_threads.py)
        self.stopping = False  # the loop is going away: end the run after the running step
        # What a hand-over raised on the loop; it ends the run, and the loop raises it.
        self.failure: BaseException | None = None

    def run(
        self,
        loop: asyncio.AbstractEventLoop,
        hand_over: Callable[[FinishedStep], None],
        may_go_on: Callable[[], bool],
    ) -> FinishedStep:
        """On the compute thread: one step, then more while `may_go_on()` (called here, so it
        may only read the loop's state) and the engine has work. Each step but the last goes
        to `hand_over` on the loop as it ends; the last is returned."""
        try:
            while True:
                step = self._step()
                ran_nothing = step.record is None  # nothing schedulable: the loop waits instead
                if ran_nothing or self.stopping or not may_go_on():
                    return step
                if not self.engine.has_unfinished_requests():
                    return step
                loop.call_soon_threadsafe(self._hand_over, hand_over, step)
        finally:
            # NOTE: here too, not only by the loop: a run that the loop stopped waiting for
            # (cancelled) may still finish a step after the loop cleared it.
            self.started = None

    def _hand_over(self, hand_over: Callable[[FinishedStep], None], step: FinishedStep) -> None:
        """On the loop. A failure here is the engine's (outputs would be lost), not swallowed
        by the loop's exception handler as a callback's would be."""
        if self.stopping:
            return  # the engine is failing or going away: its requests fail with it
        try:
            hand_over(step)
        except BaseException as exc:  # noqa: BLE001 - raised again by the loop, loudly
            self.failure = exc
            self.stopping = True

    def _step(self) -> FinishedStep:
        engine = self.engine
        num_steps = engine.num_steps
        self.started = started = time.monotonic()
        outputs = engine.step(self.streaming)
        self.slowest_s = max(time.monotonic() - started, self.slowest_s * SLOWEST_DECAY)
        self.num_timed_steps += 1
        record = None
        if engine.num_steps > num_steps:
            record = StepRecord.of(engine, sum(len(o.new_token_ids) for o in outputs))
        return FinishedStep(outputs, record, engine.stats())
