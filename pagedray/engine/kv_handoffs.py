"""An engine's side of pulls (scheduler/kv_transfer.py): blocks other engines asked it for,
and blocks it was given, applied by its event loop between runs of steps.

An export takes two turns of the loop: first the asked blocks that its pool caches are handed
to the next plan's saves (`apply`), then, once a step has run and published them in the node's
tier, the answer is read from the tier (`answer`). Meanwhile the run of steps in flight ends
at its next step (`waiting`), so that a loaded holder answers within one step. An import is
written into the tier before the requests queued with it are admitted, so their prefix lookup
finds it. A hand-off that fails is its puller's loss (it computes the blocks), never the
engine's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.kv_transfer import (
    KVExport,
    export_from_tier,
    import_into_tier,
    offer_cached_prefix,
)
from pagedray.scheduler.prefix_hash import BlockHash

logger = logging.getLogger(__name__)


@dataclass
class _Export:
    block_hashes: Sequence[BlockHash]
    with_bytes: bool
    answer: asyncio.Future[KVExport]


class KVHandoffs:
    """The exports and imports waiting for an engine's next turn between runs. Used on the
    engine's event loop only."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._asked: list[_Export] = []  # not yet offered to a plan
        self._saving: list[_Export] = []  # offered: answered once a step has run
        self._imports: list[KVExport] = []
        self.num_exported_blocks = 0
        self.num_imported_blocks = 0

    def export(
        self, block_hashes: Sequence[BlockHash], with_bytes: bool
    ) -> asyncio.Future[KVExport]:
        """The leading run of `block_hashes` this engine's pool or its node's tier holds, once
        in the tier (with the bytes if `with_bytes`); none without a tier."""
        answer: asyncio.Future[KVExport] = asyncio.get_running_loop().create_future()
        if self.core.scheduler.kv_cache_manager.host_tier is None:
            answer.set_result(KVExport([]))
        else:
            self._asked.append(_Export(block_hashes, with_bytes, answer))
        return answer

    def give(self, export: KVExport) -> None:
        """Blocks from another node's engine, for the requests added after this call (the
        engine's loop writes them; a dead engine's are dropped by `fail_all`)."""
        if export.payloads and self.core.scheduler.kv_cache_manager.host_tier is not None:
            self._imports.append(export)

    def waiting(self) -> bool:
        """Whether something waits for the loop's next turn (a run of steps should end)."""
        return bool(self._asked or self._saving or self._imports)

    def needs_step(self) -> bool:
        """Whether offered blocks wait for a step to save them (one runs even if idle)."""
        return bool(self._saving)

    def apply(self) -> None:
        """Between runs, before queued requests are admitted: write the imports into the tier
        and offer the blocks of the new exports to the next plan's saves."""
        manager = self.core.scheduler.kv_cache_manager
        tier = manager.host_tier
        imports, self._imports = self._imports, []
        for given in imports:
            assert tier is not None
            try:
                self.num_imported_blocks += import_into_tier(tier, given)
            except Exception:  # noqa: BLE001 - a full /dev/shm, a bad block: computed instead
                logger.warning("writing pulled KV blocks into the host tier failed", exc_info=True)
        asked, self._asked = self._asked, []
        for export in asked:
            if export.answer.done():  # the puller gave up
                continue
            offer_cached_prefix(manager, export.block_hashes)
            self._saving.append(export)

    def answer(self) -> None:
        """After a step ran (its plan carried the offered blocks' saves): answer the exports
        from the tier."""
        tier = self.core.scheduler.kv_cache_manager.host_tier
        saving, self._saving = self._saving, []
        for export in saving:
            if export.answer.done():
                continue
            assert tier is not None
            try:
                result = export_from_tier(tier, export.block_hashes, export.with_bytes)
            except Exception as exc:  # noqa: BLE001 - the puller's loss: it computes them
                logger.warning("reading KV blocks to export failed", exc_info=True)
                export.answer.set_exception(exc)
                continue
            self.num_exported_blocks += len(result.block_hashes)
            export.answer.set_result(result)

    def fail_all(self, exc: BaseException) -> None:
        for export in [*self._asked, *self._saving]:
            if not export.answer.done():
                export.answer.set_exception(exc)
        self._asked, self._saving, self._imports = [], [], []

    def stats(self) -> dict[str, int]:
        return {
            "num_kv_exported_blocks": self.num_exported_blocks,
            "num_kv_imported_blocks": self.num_imported_blocks,
        }
