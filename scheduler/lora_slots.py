"""Which LoRA adapters sit in the workers' slots, as the block table says which blocks hold KV.

Every rank keeps `max_loras` device slots of stacked adapter weights. The scheduler owns the
slot table: a request naming an adapter is admitted only when its adapter is in a slot or can
be put in one (a free slot, or one whose adapter no running sequence uses, least recently used
first); the plan then tells every rank to load it (`SchedulerOutput.lora_loads`) before the
step runs. So one step never holds more than `max_loras` adapters, as vLLM's `--max-loras`
bounds a batch, and an adapter that running sequences use is never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedray.scheduler.messages import LoRALoad
from pagedray.scheduler.request import Request


class LoRASlots:
    """The adapters an engine knows (name -> path) and which of them each slot holds."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.paths: dict[str, str] = {}  # every adapter requests may name
        self._slot_of: dict[str, int] = {}  # adapters in a slot
        self._users: dict[str, int] = {}  # running sequences per adapter in a slot
        self._idle: OrderedDict[str, None] = OrderedDict()  # in a slot, unused: oldest first
        self._free = list(range(max_loras - 1, -1, -1))
        self._loads: list[LoRALoad] = []
        self.num_loads = 0  # adapters put in a slot, all steps
        # Finds (and checks) the folder of an adapter a request names that is not registered;
        # raises ValueError when there is none. None: only registered names run.
        self.resolver: Callable[[str], str] | None = None

    def register(self, name: str, path: str) -> None:
        """Let requests name `name` (again with the same path: nothing changes).

        Raises:
            ValueError: `name` is registered with another path (unregister it first).
        """
        if self.paths.get(name) not in (None, path):
            raise ValueError(f"lora_name: {name!r} is already loaded from {self.paths[name]!r}")
        self.paths[name] = path

    def unregister(self, name: str) -> bool:
        """Forget `name` (False: unknown); sequences that use it keep their slot until they end."""
        if self.paths.pop(name, None) is None:
            return False
        if self._users.get(name, 0) == 0:
            self._evict(name)
        return True

    def knows(self, name: str) -> bool:
        """Whether requests may name `name`: registered, or found by the resolver (which
        registers it; ValueError: it found no adapter of that name)."""
        if name not in self.paths and self.resolver is not None:
            self.register(name, self.resolver(name))
        return name in self.paths

    def can_hold(self, name: str) -> bool:
        """Whether a sequence of `name` could be admitted now."""
        return name in self._slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, req: Request) -> None:
        """Give an admitted sequence its adapter's slot (loading it where needed); call only
        after `can_hold`."""
        name = req.lora_name
        assert name is not None
        slot = self._slot_of.get(name)
        if slot is None:
            if not self._free:
                self._evict(next(iter(self._idle)))
            slot = self._free.pop()
            self._slot_of[name] = slot
            self._users[name] = 0
            self._loads.append(LoRALoad(slot, name, self.paths[name]))
            self.num_loads += 1
        self._idle.pop(name, None)
        self._users[name] += 1
        req.lora_slot = slot

    def fork(self, parent: Request, children: list[Request]) -> None:
        """A prefilled n > 1 prompt became `children`: each holds the parent's slot."""
        if parent.lora_name is None or parent.lora_slot is None:
            return
        for child in children:
            child.lora_slot = parent.lora_slot
        self._users[parent.lora_name] += len(children) - 1
        parent.lora_slot = None

    def release(self, req: Request) -> None:
        """A sequence left the running set (finished or preempted)."""
        name = req.lora_name
        if name is None or req.lora_slot is None:
            return
        req.lora_slot = None
        self._users[name] -= 1
        if self._users[name] == 0:
            if name in self.paths:
                self._idle[name] = None
            else:  # unregistered while in use
                self._evict(name)

    def empty(self, slot: int) -> None:
        """The ranks could not load `slot`: no sequence holds it any more (they were ended);
        its adapter is out of the slots."""
        name = next((n for n, s in self._slot_of.items() if s == slot), None)
        if name is not None:
            self._evict(name)

    def take_loads(self) -> list[LoRALoad]:
        """The slots this step fills, once: the next plan carries them."""
        loads, self._loads = self._loads, []
        return loads

    def running_adapters(self) -> list[str]:
        return sorted(name for name, users in self._users.items() if users)

    def stats(self) -> dict[str, float]:
        """Adapters running now, and adapters put in a slot so far (a count that climbs with
        each request says `--max-loras` is too small for the adapters in use)."""
        return {
            "num_lora_adapters_running": len(self.running_adapters()),
            "num_lora_loads": self.num_loads,
        }

    def _evict(self, name: str) -> None:
        slot = self._slot_of.pop(name, None)
        if slot is None:
            return
        self._users.pop(name, None)
        self._idle.pop(name, None)
        self._free.append(slot)
        # A load of it still unsent must not overwrite whatever takes the slot next.
        self._loads = [load for load in self._loads if load.name != name]
