"""Deploying apps on the shared Serve instance (`serve_url`), each under its own route prefix."""

from __future__ import annotations

from typing import Any, Iterator


def deploy_app(serve_url: str, name: str, app: Any) -> Iterator[str]:
    """Run `app` under the route prefix `/name` for a fixture's lifetime; yields its URL."""
    from ray import serve

    serve.run(app, name=name, route_prefix=f"/{name}")
    yield f"{serve_url}/{name}"
    serve.delete(name)


def deploy_tiny(serve_url: str, name: str, model: str, **args: Any) -> Iterator[str]:
    """The tiny model served by an in-process engine (one process fewer), with `args` on top."""
    from pagedray.cluster.openai_app import build_app

    base = {"model": model, "num_threads": 1, "ingress_num_cpus": 0.1, "use_ray_workers": False}
    yield from deploy_app(serve_url, name, build_app({**base, **args}))
