"""Which LoRA adapters sit in the workers' slots, as the block table says which blocks hold KV.

Every rank keeps `max_loras` device slots of stacked adapter weights. The scheduler owns the
slot table. A request naming an adapter that is in no slot is not admitted at once: when a slot
can take the adapter (a free one, or one whose adapter no running sequence uses, least recently
used first) the next plan tells every rank to load it (`SchedulerOutput.lora_loads`), and the
request is admitted once the step reports the load done. So a sequence never runs on a slot
that failed to load (the requests waiting for it end instead, and nothing of them was computed
or cached), one step never holds more than `max_loras` adapters, as vLLM's `--max-loras`
bounds a batch, and an adapter that running sequences use is never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedray.scheduler.messages import LoRALoad
from pagedray.scheduler.request import Request


class LoRASlots:
    """The adapters an engine knows and which of them each slot holds.

    An adapter is known by an id: its key (name and files' identity) and folder when a request
    names it (`adapter_id`), so that a name pointed at another folder at run time
    (`/v1/load_lora_adapter`) or weights written again into its folder is another adapter, and
    a request runs with the one its name meant when it arrived.
    """

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.folders: dict[str, str] = {}  # registered name -> its folder (checked)
        self.paths: dict[str, str] = {}  # adapter id -> its folder
        self._names: dict[str, str] = {}  # adapter id -> the name requests give it
        # What its prefix-cache blocks are hashed with: its name and its files' identity, so a
        # folder rewritten in place (an adapter trained again) shares no blocks with before.
        self.keys: dict[str, str] = {}
        self._slot_of: dict[str, int] = {}  # adapters in a slot, loaded or loading
        self._loading: set[str] = set()  # a plan loads them; not admitted on until it ran
        self._users: dict[str, int] = {}  # running sequences per adapter in a slot
        self._idle: OrderedDict[str, None] = OrderedDict()  # loaded, unused: oldest first
        self._free = list(range(max_loras - 1, -1, -1))
        self._loads: list[LoRALoad] = []
        self.num_loads = 0  # adapters put in a slot, all steps
        # The resolver's folder: where a name not registered leads now (None: nowhere), and the
        # check of that folder (ValueError: no adapter this model can use). None: none.
        self.locate: Callable[[str], str | None] | None = None
        self.resolver: Callable[[str], str] | None = None
        # An adapter's key from its name and folder (the engine's: its files' identity; raises
        # OSError for a folder it cannot read).
        self.key_of: Callable[[str, str], str] = lambda name, path: name

    def register(self, name: str, path: str) -> None:
        """Let requests name `name`, the adapter in the folder `path` (again with the same
        folder: nothing changes).

        Raises:
            ValueError: `name` is registered with another folder.
        """
        if self.folders.get(name) not in (None, path):
            raise ValueError(f"lora_name: {name!r} is already loaded from {self.folders[name]!r}")
        self.folders[name] = path

    def adapter_id(self, name: str) -> str | None:
        """The adapter a request naming `name` runs with, as its folder holds it now: a
        registered name's folder, else the one the resolver's folder leads to (checked when
        first seen; ValueError: it is no adapter this model can use); None: no adapter of that
        name. Its id holds its key, so weights written again into a folder (a retrain, vLLM's
        `load_inplace` of the same path) are another adapter, loaded afresh, and a request
        runs with what its name meant when it arrived.

        Raises:
            ValueError: the adapter's files cannot be read now.
        """
        folder, checked = self.folders.get(name), True
        if folder is None and self.locate is not None and self.resolver is not None:
            folder, checked = self.locate(name), False
        if folder is None:
            return None
        try:
            key = self.key_of(name, folder)
        except OSError:
            if not checked and self.resolver is not None:
                self.resolver(name)  # its refusal says why, as the client may read it
            # No path in the message: a client reads it.
            raise ValueError(f"model: the LoRA adapter {name!r} cannot be read") from None
        adapter = f"{key}@{folder}"
        if adapter not in self.paths:
            if not checked:
                assert self.resolver is not None
                self.resolver(name)  # the folder's adapter fits the model, or ValueError
            self.paths[adapter] = folder
            self._names[adapter] = name
            self.keys[adapter] = key
        return adapter

    def waits_for_slot(self, name: str) -> bool:
        """After `ready` said no: whether no slot could take `name` (else it is loading)."""
        return name not in self._slot_of

    def ready(self, name: str) -> bool:
        """Whether a sequence of `name` may be admitted now: its adapter is loaded in a slot.
        If it is in none and a slot can take it, the next plan loads it (`take_loads`)."""
        if name in self._slot_of:
            return name not in self._loading
        if self._free or self._idle:
            if not self._free:
                self._evict(next(iter(self._idle)))
            slot = self._free.pop()
            self._slot_of[name] = slot
            self._users[name] = 0
            self._loading.add(name)
            load = LoRALoad(slot, name, self._names[name], self.paths[name], self.keys[name])
            self._loads.append(load)
            self.num_loads += 1
        return False

    def acquire(self, req: Request) -> None:
        """Give an admitted sequence its adapter's slot; call only once `ready`."""
        name = req.lora_id
        assert name is not None and self.ready(name)
        self._idle.pop(name, None)
        self._users[name] += 1
        req.lora_slot = self._slot_of[name]

    def fork(self, parent: Request, children: list[Request]) -> None:
        """A prefilled n > 1 prompt became `children`: each holds the parent's slot."""
        if parent.lora_id is None or parent.lora_slot is None:
            return
        for child in children:
            child.lora_slot = parent.lora_slot
        self._users[parent.lora_id] += len(children) - 1
        parent.lora_slot = None

    def release(self, req: Request) -> None:
        """A sequence left the running set (finished or preempted)."""
        name = req.lora_id
        if name is None or req.lora_slot is None:
            return
        req.lora_slot = None
        self._users[name] -= 1
        if self._users[name] == 0:
            self._idle[name] = None

    def take_loads(self) -> list[LoRALoad]:
        """The slots the next step fills, once: the plan carries them."""
        loads, self._loads = self._loads, []
        return loads

    def loaded(self, loads: list[LoRALoad], failed_slots: list[int]) -> list[str]:
        """A step ran `loads` (its plan's); those in `failed_slots` left their slot empty on
        some rank. Returns the adapters that failed (out of the slots again: the requests
        waiting for them end, and the next one to name them tries anew)."""
        failed = []
        for load in loads:
            self._loading.discard(load.adapter)
            if load.slot in failed_slots:
                self._evict(load.adapter)
                failed.append(load.adapter)
            elif self._users.get(load.adapter) == 0:
                self._idle[load.adapter] = None
        return failed

    def lost(self, loads: list[LoRALoad]) -> None:
        """The step that carried `loads` failed before they ran: out of the slots again."""
        for load in loads:
            self._loading.discard(load.adapter)
            self._evict(load.adapter)

    def running_adapters(self) -> list[str]:
        return sorted({self._names[adapter] for adapter, users in self._users.items() if users})

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
        self._loads = [load for load in self._loads if load.adapter != name]
