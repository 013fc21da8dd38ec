"""An engine replica's side of a pull (issue P15): before admitting a request the router sent
away from the replica caching its prefix, ask that replica for the blocks, over Serve.

The holder is asked by an addressed `export_kv` call through a handle to the engines' own
deployment; what it answers goes into this replica's engine before the request is added
(scheduler/kv_transfer.py has the data, pagedray/engine/kv_handoffs.py the engine's side).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.output_channel import REPLICA_ID_KWARG
from pagedray.engine.wire import GenerateRequest, KVPull
from pagedray.scheduler.kv_transfer import TierAddress
from pagedray.scheduler.prefix_hash import compute_block_hashes

# How long a request waits for the blocks it pulls (the holder's step in flight, a round trip)
# before it computes them instead.
PULL_TIMEOUT_S = 2.0

logger = logging.getLogger(__name__)


class KVPuller:
    """Pulls for the engine of one replica (`replica_id`), whose node tier is `tier_address`
    (None: no tier, so nothing to pull into)."""

    def __init__(
        self, engine: AsyncEngine, replica_id: str, tier_address: TierAddress | None
    ) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.tier_address = tier_address
        self._engines: Any = None  # a handle to the engines' deployment, made at the first pull

    async def pull(self, request: GenerateRequest, pull: KVPull) -> None:
        """Have the replica holding `request`'s prefix put the blocks this one lacks (from
        `pull.first_block` on) into its node's tier, with their bytes if that tier is not this
        one's: admission then loads them. Best effort: a holder that is gone, fails or takes
        over `PULL_TIMEOUT_S` leaves them to be computed."""
        if self.tier_address is None or pull.replica_id == self.replica_id:
            return
        block_size = self.engine.core.scheduler.config.block_size
        prompt = request.prompt_token_ids
        hashes = compute_block_hashes(prompt, block_size, request.cache_salt, [], request.lora_key)
        hashes = hashes[pull.first_block : pull.num_blocks]
        call: Any = None
        try:
            if self._engines is None:
                context = serve.get_replica_context()
                self._engines = serve.get_deployment_handle(
                    context.deployment, context.app_name
                ).options(stream=False)
            call = self._engines.export_kv.remote(
                hashes, self.tier_address, **{REPLICA_ID_KWARG: pull.replica_id}
            )
            export = await asyncio.wait_for(call, PULL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a timeout, a holder gone: compute them
            if call is not None:
                call.cancel()
            holder = pull.replica_id
            logger.info("pulling %d KV blocks from %s failed: %r", len(hashes), holder, exc)
            return
        self.engine.give_kv(export)
        logger.debug(
            "%s: pulled %d of %d KV blocks from %s",
            request.request_id, len(export.block_hashes), len(hashes), pull.replica_id,
        )  # fmt: skip
