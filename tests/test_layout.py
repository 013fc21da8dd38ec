"""The layout's rules, held by tests: which packages may import what.

Each rule imports every module of a package in a fresh interpreter and looks at `sys.modules`
afterwards, so an import hidden three modules deep breaks it as surely as one at the top. A
module may still import Ray lazily inside a function (the engine factory does, for TP > 1): the
rule is about what importing the package costs and drags in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folders of the installed `pagedray.*` packages (pyproject's package-dir).
PACKAGE_DIRS = {
    "pagedray.scheduler": ROOT / "scheduler",
    "pagedray.workers": ROOT / "workers",
    "pagedray.attention": ROOT / "attention",
    "pagedray.cluster": ROOT / "cluster",
    "pagedray.engine": ROOT / "pagedray" / "engine",
    "pagedray.openai": ROOT / "pagedray" / "openai",
    "pagedray.cli": ROOT / "pagedray" / "cli",
    "pagedray.tools": ROOT / "pagedray" / "tools",
    "pagedray.observability": ROOT / "pagedray" / "observability",
}
# package -> top-level modules it must not pull in.
FORBIDDEN = {
    "pagedray.scheduler": ["torch", "ray"],
    "pagedray.workers": ["ray"],
    "pagedray.attention": ["ray"],
    "pagedray.engine": ["ray", "fastapi", "starlette"],
    "pagedray.openai": ["ray"],
}


def _modules_of(package: str) -> list[str]:
    folder = PACKAGE_DIRS[package]
    return sorted(
        f"{package}.{path.relative_to(folder).with_suffix('').as_posix().replace('/', '.')}"
        for path in folder.rglob("*.py")
        if path.name != "__init__.py"
    )


def _imported_after(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return set(json.loads(result.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_inside_its_boundary(package: str) -> None:
    modules = _modules_of(package)
    assert modules, f"{package} has no modules: PACKAGE_DIRS is stale"
    pulled_in = _imported_after(modules) & set(FORBIDDEN[package])
    assert not pulled_in, f"importing {package} imports {sorted(pulled_in)}"


# What `pagedray serve`'s own process imports to parse its flags, build the app and drive Ray. It
# never runs the model or a tokenizer (the replicas do), and torch with transformers took 5-7 s of
# every start there.
SERVE_DRIVER_MODULES = [
    "pagedray.cli.main",
    "pagedray.cli.serve",
    "pagedray.cluster.openai_app",
    "pagedray.cluster.serve_app",
    "pagedray.tools.default_model",
    "pagedray.observability.ray_grafana",
]


def test_the_serve_driver_loads_no_model_libraries() -> None:
    pulled_in = _imported_after(SERVE_DRIVER_MODULES) & {"torch", "transformers", "tokenizers"}
    assert not pulled_in, f"pagedray serve's driver imports {sorted(pulled_in)}"


def test_every_source_folder_is_a_known_package() -> None:
    """A new package folder gets a rule here (or a deliberate absence of one)."""
    folders = {p.parent for p in (ROOT / "pagedray").rglob("__init__.py")} - {ROOT / "pagedray"}
    assert folders <= set(PACKAGE_DIRS.values())
