"""The layout's rules, held by tests: the import contracts (pyproject's [tool.importlinter],
which CI also runs), a `pagedray.*` name for every file, and what `pagedray serve`'s own process
drags in when it imports its modules.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The folders whose modules are `pagedray.*` (the card's folders at the top, linked into
# pagedray/ so that every module's name is the path of its file there).
SOURCE_DIRS = ["pagedray", "scheduler", "workers", "attention", "cluster"]


def _source_files() -> list[Path]:
    return sorted(path for folder in SOURCE_DIRS for path in (ROOT / folder).rglob("*.py"))


def test_the_import_contracts_hold() -> None:
    """Layers, no Ray below the cluster, no torch in the scheduler, no cycles: every import,
    lazy or under TYPE_CHECKING, counts."""
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is a test dependency (pyproject.toml)"
    result = subprocess.run([lint_imports], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:]


def _imported_names(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each `pagedray.*` import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name, []) for a in node.names if a.name.startswith("pagedray")
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("pagedray"):
                continue
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def _module_file(name: str) -> Path | None:
    """The file a module name spells from the repository root, if there is one."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_every_pagedray_import_names_a_file_where_its_name_says() -> None:
    """What an editor, mypy or an import grapher reading the repository looks for: the file
    behind `pagedray.scheduler.block_pool` is pagedray/scheduler/block_pool.py."""
    missing = []
    for path in _source_files():
        for line, module, names in _imported_names(path):
            if _module_file(module) is None:
                missing.append(f"{path.relative_to(ROOT)}:{line}: {module}")
                continue
            for name in names:  # `from pagedray.x import y`: y is a module or defined in x
                if _module_file(f"{module}.{name}") is None and name != "*":
                    source = _module_file(module).read_text()  # type: ignore[union-attr]
                    if name not in source:
                        missing.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name}")
    assert not missing, missing


# What `pagedray serve`'s own process imports to parse its flags, build the app and drive Ray. It
# never runs the model or a tokenizer (the replicas do), and torch with transformers took 5-7 s of
# every start there.
SERVE_DRIVER_MODULES = [
    "pagedray.cli.main",
    "pagedray.cli.serve",
    "pagedray.cluster.openai_app",
    "pagedray.cluster.ingress_deployment",
    "pagedray.tools.default_model",
    "pagedray.observability.ray_grafana",
]


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


def test_the_serve_driver_loads_no_model_libraries() -> None:
    pulled_in = _imported_after(SERVE_DRIVER_MODULES) & {"torch", "transformers", "tokenizers"}
    assert not pulled_in, f"pagedray serve's driver imports {sorted(pulled_in)}"


@pytest.mark.parametrize("folder", ["scheduler", "workers", "attention", "cluster"])
def test_each_card_folder_is_linked_into_the_package(folder: str) -> None:
    link = ROOT / "pagedray" / folder
    assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve()
