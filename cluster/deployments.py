"""The Ray Serve application: an ingress deployment (the HTTP layer over a ``RayBackend``, serving HTTP itself) bound
to the engine deployment (``EngineReplica``s behind the prefix-affinity router), configured from the command line's
flags. Serve's own HTTP proxies are not used (``proxy_location: Disabled``).

``app_builder`` is the same application for ``serve deploy``/``serve run`` (``cluster/serve.yaml``): its ``args``
are the command line's flags, spelled as YAML keys (``max_batch_size: 64``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
from typing import Any

import uvicorn
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from app.server.app import create_app
from app.server.cli import engine_config, parse_args, server_config
from app.server.serve import EmbeddedServer, drain
from app.server.state import ServerConfig, server_state
from cluster import RAY_ENV
from cluster.backend import RayBackend
from cluster.replica import EngineReplica, configure_logging, reports_actor

APP_NAME = "smolserve"

#: Ray's resource that only the head node has.
HEAD_NODE = "node:__internal_head__"


def application(args: argparse.Namespace, name: str = APP_NAME) -> Application:
    servers = server_config(args)
    engine = serve.deployment(EngineReplica).options(**engine_options(args))
    # Replicas serve generation only: /v1/embeddings is a one-process feature for now (docs/api.md).
    engine = engine.bind(
        dataclasses.replace(engine_config(args), embedding_model="none"), servers, name, args.log_level
    )
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=1,
        ray_actor_options={
            "num_cpus": 0,
            "runtime_env": {"env_vars": RAY_ENV},
            "resources": {HEAD_NODE: 0.001},  # the HTTP port is on the head node, where the launcher runs
        },
        graceful_shutdown_timeout_s=args.shutdown_timeout + 5,
    )
    return ingress.bind(engine, servers, name, args.log_level, args.host, args.port)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Each replica takes as many requests as its batch and queue hold (Ray's default of 5 would starve continuous
    batching); past that the ingress's handle queues ``--max-queue`` more, then answers 429."""
    most = args.max_replicas or args.replicas or 1
    cpus = args.replica_cpus or max((os.cpu_count() or 1) // most, 1)
    # torch takes every core by default: replicas sharing a machine would each run that many threads.
    env = {**RAY_ENV, "OMP_NUM_THREADS": str(max(int(cpus), 1))}
    options: dict[str, Any] = {
        "name": "EngineReplica",
        "max_ongoing_requests": args.max_batch_size + args.max_queue,
        "max_queued_requests": args.max_queue,
        "ray_actor_options": {"num_cpus": cpus, "runtime_env": {"env_vars": env}},
        "request_router_config": RequestRouterConfig(
            request_router_class="cluster.router:PrefixAffinityRouter",
        ),
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
    }
    if args.min_replicas is not None:
        options["autoscaling_config"] = autoscaling(args)
    else:
        options["num_replicas"] = args.replicas or 1
    return options


def autoscaling(args: argparse.Namespace) -> dict[str, Any]:
    """Serve's autoscaler on ongoing requests per replica. The target is half a batch: a replica past it is running
    a big enough batch that its tokens per second per stream start to drop (bench/README.md), and a new replica
    takes a while (loading the model) to arrive, so scaling starts before requests queue."""
    return {
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "initial_replicas": args.replicas or max(args.min_replicas, 1),
        "target_ongoing_requests": max(args.max_batch_size // 2, 1),
        "upscale_delay_s": 5,
        "downscale_delay_s": 60,
    }


class Ingress:
    """The HTTP layer of ``app/`` in one Serve replica, over the engine deployment's handle. It serves HTTP itself
    (uvicorn on ``--host``:``--port``, as the one-process server does) instead of behind Serve's proxy: the proxy
    would add a Ray hop to every streamed token, and on this 2-core machine that hop cost ~10% of throughput."""

    async def __init__(
        self, engine: DeploymentHandle, config: ServerConfig, name: str, log_level: str, host: str, port: int
    ) -> None:
        configure_logging(log_level)
        model = await engine.model_info.remote()
        self._app = create_app(model, config, RayBackend(engine, reports_actor(name), config.max_queue))
        self._server = EmbeddedServer(
            uvicorn.Config(self._app, host=host, port=port, log_level=log_level, access_log=False)
        )
        self._serving = asyncio.create_task(self._server.serve())
        while not self._server.started:  # a port in use fails the replica here, and Serve retries it
            if self._serving.done():
                raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
            await asyncio.sleep(0.05)

    async def drain(self, timeout: float) -> None:
        """What SIGTERM does to the one-process server: 503 for newcomers, in-flight requests finish (up to
        ``timeout``), the rest end with an error. The launcher calls it before shutting Serve down."""
        await drain(server_state(self._app), timeout)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose HTTP server stopped is replaced."""
        if self._serving.done():
            raise RuntimeError("the HTTP server stopped")

    async def __del__(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._serving, timeout=10)


def app_builder(args: dict[str, Any]) -> Application:
    """For ``serve run cluster.deployments:app_builder key=value`` and ``serve deploy cluster/serve.yaml``."""
    return application(parse_args(flags(args)))


def flags(args: dict[str, Any]) -> list[str]:
    """A config file's ``args`` as the command line: ``{"max_batch_size": 64, "no_prefix_caching": True}`` is
    ``--max-batch-size 64 --no-prefix-caching``."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv
