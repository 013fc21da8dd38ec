"""pagedray's dashboard written where Ray's provisioned Grafana loads its own. That
`pagedray serve` does it is checked in tests/deploy/test_serve_api_port.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedray.observability.grafana_dashboard import DASHBOARD_UID, dashboard_json
from pagedray.observability.ray_grafana import (
    DASHBOARD_FILE,
    provision_dashboard,
    ray_dashboards_folder,
)


@pytest.fixture(autouse=True)
def rays_default_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's folders where its environment leaves them (a test may move them)."""
    monkeypatch.delenv("RAY_METRICS_OUTPUT_ROOT", raising=False)
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)


def test_written_into_an_existing_folder_whole_and_readable(tmp_path: Path) -> None:
    folder = ray_dashboards_folder(tmp_path, "session_x")
    assert folder == tmp_path / "session_x" / "metrics" / "grafana" / "dashboards"
    folder.mkdir(parents=True)
    (folder / DASHBOARD_FILE).write_text("stale")
    path = provision_dashboard(folder)
    assert path == folder / DASHBOARD_FILE
    assert path.read_text() == dashboard_json()
    assert json.loads(path.read_text())["uid"] == DASHBOARD_UID
    assert path.stat().st_mode & 0o777 == 0o644  # Grafana may run as another user
    assert [p.name for p in folder.iterdir()] == [DASHBOARD_FILE]  # no staging file left


def test_rays_environment_moves_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_METRICS_OUTPUT_ROOT", str(tmp_path / "root"))
    assert ray_dashboards_folder("/tmp/ray", "s") == tmp_path / "root" / "grafana" / "dashboards"
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", str(tmp_path / "d"))
    assert ray_dashboards_folder("/tmp/ray", "s") == tmp_path / "d"


def test_nothing_where_ray_provisions_no_grafana(tmp_path: Path) -> None:
    folder = ray_dashboards_folder(tmp_path, "session_x")
    assert provision_dashboard(folder) is None
    assert not folder.exists()
