"""Adapters an engine serves: checked against the model where they are named, then known to
the scheduler, which loads them into the ranks' slots as requests need them.

`LoRARequest` is vLLM's offline spelling (`LLM.generate(..., lora_request=...)`); a server
names its adapters with `--lora-modules`, or a folder of them (`--lora-resolver-dir`), and
requests pick one by `model`.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedray.engine.config import EngineConfig
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.request_failure import refusal
from pagedray.workers.lora_checkpoint import adapter_key, read_adapter
from pagedray.workers.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for offline requests, as vLLM's: its name, an id, its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def add_adapter(core: EngineCore, config: EngineConfig, name: str, path: str) -> None:
    """Let requests name the adapter at `path` as `name`.

    Raises:
        ValueError: LoRA is off in `config`, the adapter does not fit the model (its rank,
            shapes or format), or `name` is taken by another path.
    """
    slots = core.scheduler.lora_slots
    if slots is None:
        raise ValueError("lora_request: this engine was built without enable_lora")
    if slots.folders.get(name) == str(Path(path).expanduser().resolve()):
        return  # known already: checked when it was added
    model = ModelConfig.from_pretrained(config.model, config.dtype)
    slots.register(name, read_adapter(name, path, model, config.max_lora_rank).path)


def resolver(config: EngineConfig) -> Callable[[str], str] | None:
    """With `lora_resolver_dir`: the check of an adapter a request names that the engine does
    not know yet (its folder there, checked against the model), as vLLM's filesystem resolver:
    the folder, or a refusal of `model` (the reason in the log, not in the answer: it would
    show the server's paths); None without one."""
    if config.lora_resolver_dir is None:
        return None
    model = ModelConfig.from_pretrained(config.model, config.dtype)

    def resolve(name: str) -> str:
        path = config.resolvable_lora(name)
        if path is None:
            raise refusal("model", f"{name!r} does not exist")
        try:
            return read_adapter(name, path, model, config.max_lora_rank).path
        except ValueError as error:
            logger.warning("LoRA adapter %r cannot be used: %s", name, error)
            raise refusal("model", f"{name!r} is no LoRA adapter this model can use") from None

    return resolve


def configured_adapters(config: EngineConfig) -> dict[str, str]:
    """name -> folder of each adapter `--lora-modules` names, checked against the model (before
    any rank starts: a misnamed folder fails the engine at once, with its reason)."""
    if not config.lora_modules:
        return {}
    model = ModelConfig.from_pretrained(config.model, config.dtype)
    return {
        name: read_adapter(name, path, model, config.max_lora_rank).path
        for name, path in config.lora_adapters().items()
    }


def serve_adapters(core: EngineCore, config: EngineConfig, adapters: dict[str, str]) -> None:
    """Let `core`'s requests name `adapters` (checked), and those its resolver finds; their
    blocks hashed by their files' identity (`adapter_key`)."""
    slots = core.scheduler.lora_slots
    if slots is None:
        return
    slots.key_of = adapter_key
    for name, path in adapters.items():
        slots.register(name, path)
    slots.resolver = resolver(config)
    if slots.resolver is not None:
        slots.locate = lambda name: located(config, name)


def located(config: EngineConfig, name: str) -> str | None:
    """The folder `name` leads to in `lora_resolver_dir` now (links followed), if it holds an
    adapter."""
    path = config.resolvable_lora(name)
    return None if path is None else str(Path(path).resolve())


def link_adapter(config: EngineConfig, name: str, path: str, replace: bool = False) -> None:
    """vLLM's `/v1/load_lora_adapter`: the adapter at `path` (checked against the model) linked
    into `lora_resolver_dir` as `name`, which every engine's resolver then finds; `replace`
    (vLLM's `load_inplace`): a name linked before is pointed at `path` (requests that arrive
    after run with it; those before keep theirs).

    Raises:
        ValueError: the name is taken (a served model, a `--lora-modules` adapter, a folder
            of the resolver's own, or, without `replace`, a link), or the adapter does not fit.
    """
    root = Path(config.lora_resolver_dir or "")
    if not config.allow_runtime_lora_updating or not config.lora_resolver_dir:
        raise refusal("lora_name", "loading LoRA adapters at run time is off on this server")
    if config.resolvable_name(name) is None:
        raise refusal("lora_name", f"{name!r} is not a plain folder name")
    link = root / name
    taken = name in config.served_names() or name in config.lora_adapters()
    if taken or (link.exists() and not link.is_symlink()) or (link.is_symlink() and not replace):
        raise refusal("lora_name", f"The lora adapter '{name}' has already been loaded.")
    model = ModelConfig.from_pretrained(config.model, config.dtype)
    folder = read_adapter(name, path, model, config.max_lora_rank).path
    staged = root / f".{name}.{uuid.uuid4().hex}"
    try:
        if not replace:
            os.symlink(folder, link)  # at once, or EEXIST: another replica loaded it first
            return
        os.symlink(folder, staged)
        os.replace(staged, link)  # at once: a resolver sees the old link or the new one
    except FileExistsError:
        raise refusal("lora_name", f"The lora adapter '{name}' has already been loaded.") from None
    except OSError as error:
        message = f"cannot link {name!r} into the resolver's folder: {error}"
        raise refusal("lora_name", message) from None
    finally:
        if staged.is_symlink():  # a replace that failed leaves no link behind
            staged.unlink(missing_ok=True)


def unlink_adapter(config: EngineConfig, name: str) -> None:
    """vLLM's `/v1/unload_lora_adapter`: the link `link_adapter` made, removed; requests that
    arrive after cannot name it (those before run on).

    Raises:
        LookupError: no adapter of that name was loaded at run time.
        ValueError: the name is an adapter this server was started with.
    """
    if not config.allow_runtime_lora_updating or not config.lora_resolver_dir:
        raise refusal("lora_name", "loading LoRA adapters at run time is off on this server")
    link = Path(config.lora_resolver_dir) / name
    if name in config.lora_adapters():
        raise refusal("lora_name", f"{name!r} was not loaded at run time: it stays")
    if config.resolvable_name(name) is None or not (link.is_symlink() or link.exists()):
        raise LookupError(f"The lora adapter '{name}' cannot be found.")
    if not link.is_symlink():
        raise refusal("lora_name", f"{name!r} was not loaded at run time: it stays")
    try:
        link.unlink()
    except FileNotFoundError:  # unloaded meanwhile, by another replica
        raise LookupError(f"The lora adapter '{name}' cannot be found.") from None
    except OSError as error:
        raise refusal("lora_name", f"cannot unlink {name!r}: {error}") from None
