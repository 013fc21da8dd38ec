"""Tests read nothing beside the repository: a user's fresh clone has nothing there.

CI's checkout sits beside other folders (a `shared/` among them) that a user's clone lacks, so a
test that reads one passes in CI and fails for every newcomer. An audit hook on `open` refuses
such a read in the test process, so CI fails first. Hidden folders beside the repository (a
home directory's `.cache`, `.triton`) and the Python installation stay readable: tools keep
their caches there wherever the clone is.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]


def _python_roots() -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()}
    roots.update(path for path in sysconfig.get_paths().values() if path)
    return sorted(os.path.realpath(root) for root in roots)


def beside_the_repository(path: str, repository: Path, allowed: list[str]) -> bool:
    """Whether `path` lies in a visible folder next to `repository` (outside it) and under none
    of the `allowed` roots."""
    resolved = os.path.realpath(path)
    parent = str(repository.parent)
    if not resolved.startswith(parent.rstrip(os.sep) + os.sep):
        return False
    relative = resolved[len(parent.rstrip(os.sep)) + 1 :]
    first = relative.split(os.sep, 1)[0]
    if first == repository.name or first.startswith("."):
        return False
    return not any(resolved == root or resolved.startswith(root + os.sep) for root in allowed)


def install() -> None:
    """Refuse, for the rest of this process, every open() of a file beside the repository."""
    allowed = [*_python_roots(), os.path.realpath(tempfile.gettempdir())]

    def refuse(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(args[0])
        if beside_the_repository(path, REPOSITORY, allowed):
            raise PermissionError(
                f"a test opened {path}, outside the repository: a fresh clone has nothing "
                "beside it; ship what the test needs under tests/"
            )

    sys.addaudithook(refuse)
