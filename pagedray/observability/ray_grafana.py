"""pagedray's dashboard beside Ray's own, in the Grafana that Ray's session provisions.

When Ray's head starts its dashboard, it writes Grafana's configuration into the session
folder (`<temp dir>/<session>/metrics/grafana/`): a `grafana.ini` and a file provider that loads
every JSON in `dashboards/` into a folder named "Ray". A Grafana started with that ini, the one
the Ray dashboard's Metrics view embeds, so shows any dashboard written there, with no upload.
This writes pagedray's there (on the node whose session has that folder: the head), once, when
the app starts: Ray's dashboard empties the folder when it (re)starts, after which the next
ingress replica or `pagedray serve` writes it again.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from pagedray.observability.grafana_dashboard import dashboard_json

logger = logging.getLogger(__name__)

DASHBOARD_FILE = "pagedray_grafana_dashboard.json"  # as Ray names its own: <name>_grafana_...
# Where Ray's dashboard writes them instead, when set (as its metrics head reads them).
METRICS_OUTPUT_ROOT_ENV = "RAY_METRICS_OUTPUT_ROOT"
DASHBOARD_OUTPUT_DIR_ENV = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"


def ray_dashboards_folder(temp_dir: str | Path, session_name: str) -> Path:
    """Where Ray's provisioned Grafana reads dashboards for this session: the session's
    `metrics/grafana/dashboards`, unless Ray's environment moves it."""
    if folder := os.environ.get(DASHBOARD_OUTPUT_DIR_ENV):
        return Path(folder)
    root = os.environ.get(METRICS_OUTPUT_ROOT_ENV) or Path(temp_dir) / session_name / "metrics"
    return Path(root) / "grafana" / "dashboards"


def provision_dashboard(folder: Path) -> Path | None:
    """Write the dashboard into Ray's provisioned `folder`; the file, or None when this node has
    no such folder (not the head, or Ray's dashboard is off). Atomic: a Grafana reading the
    folder meanwhile sees the old file or the new one, never half of one."""
    if not folder.is_dir():
        logger.debug("no Ray Grafana folder at %s: pagedray's dashboard not provisioned", folder)
        return None
    path = folder / DASHBOARD_FILE
    fd, staging = tempfile.mkstemp(dir=folder, prefix=".pagedray-", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(dashboard_json())
        os.chmod(staging, 0o644)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return path


def provision_for_this_ray_session() -> Path | None:
    """`provision_dashboard` for the Ray session this process belongs to (a driver or an actor);
    None where there is no folder to write, and never an error: the dashboard is a convenience,
    not a reason for a deployment to fail."""
    import ray

    try:
        context = ray.get_runtime_context()
        folder = ray_dashboards_folder(context.get_temp_dir(), context.get_session_name())
        return provision_dashboard(folder)
    except Exception:  # noqa: BLE001 - logged; serving goes on without it
        logger.warning("could not write pagedray's dashboard for Ray's Grafana", exc_info=True)
        return None
