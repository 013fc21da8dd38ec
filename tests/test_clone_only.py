"""The guard that keeps tests to what a fresh clone holds (tests/clone_only.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clone_only import REPOSITORY, beside_the_repository


def test_reading_beside_the_repository_fails_the_test() -> None:
    # The audit hook refuses before the file is looked up, so this holds with or without one.
    with pytest.raises(PermissionError, match="outside the repository"):
        open(REPOSITORY.parent / "shared" / "schemas" / "anything.yaml")  # noqa: SIM115


def test_what_counts_as_beside(tmp_path: Path) -> None:
    repository = tmp_path / "work" / "pagedray"
    python = tmp_path / "work" / "venv"
    allowed = [str(python)]

    def beside(path: Path) -> bool:
        return beside_the_repository(str(path), repository, allowed)

    assert beside(tmp_path / "work" / "shared" / "DESIGN.md")
    assert beside(tmp_path / "work" / "pagedray-old" / "tests" / "x.py")  # a prefix is not inside
    assert not beside(repository / "tests" / "helm" / "kuberay" / "crd.yaml.gz")
    assert not beside(tmp_path / "work" / ".cache" / "pagedray" / "models")  # tools' caches
    assert not beside(python / "lib" / "site-packages" / "ray" / "__init__.py")
    assert not beside(tmp_path / "elsewhere" / "file")  # not beside it: a temp folder, say


def test_a_clone_in_the_temp_folder_may_use_it(tmp_path: Path) -> None:
    """Cloned into /tmp, the repository has pytest's and Ray's temp folders beside it: the
    system's temp folder is one of the roots `install` allows."""
    temp = tmp_path / "tmp"
    repository = temp / "pagedray"
    allowed = [str(temp), str(tmp_path / "venv")]
    for path in (temp / "pytest-of-root" / "pytest-1" / ".lock", temp / "ray" / "session" / "x"):
        assert not beside_the_repository(str(path), repository, allowed)
