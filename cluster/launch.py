"""``python -m app --replicas N``: start (or join) Ray, run the application on Serve, drain it on SIGTERM.

Started here, the local Ray instance binds 127.0.0.1 (its node address, not the machine's interface) and is shut
down on exit; with ``--ray-address`` the application joins that cluster and only the application is removed on
exit. The HTTP ingress listens on ``--host``:``--port`` as the one-process server does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading

from cluster import RAY_ENV

log = logging.getLogger(__name__)

#: Ray's shared-memory object store: what crosses processes here is small (requests, deltas, metrics text).
OBJECT_STORE_BYTES = 256 * 2**20


def run(args: argparse.Namespace) -> None:
    local = args.ray_address is None
    if local:
        # Ray's switch for one-machine clusters, read when Ray is imported: every Ray process then advertises and
        # binds 127.0.0.1. (Without it Ray resolves "127.0.0.1" to the machine's interface address.)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    else:
        # `ray start` clusters require Ray's token authentication (its default since 2.5x): the token is read from
        # ~/.ray/auth_token or $RAY_AUTH_TOKEN, as on every node of the cluster.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    for name, value in RAY_ENV.items():  # for the Serve controller and proxy this process starts, too
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    from cluster.deployments import APP_NAME, application

    if local:
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=os.cpu_count(),
            object_store_memory=OBJECT_STORE_BYTES,
            namespace="smolserve",
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=args.ray_address, namespace="smolserve", logging_level=logging.WARNING)
    draining = False
    try:
        stop = _stop_on_signals()  # after ray.init, which installs handlers of its own
        serve.start(proxy_location="Disabled")  # the ingress serves HTTP itself (cluster/deployments.py)
        serve.run(application(args), name=APP_NAME, route_prefix=None, blocking=False)
        log.info("serving on http://%s:%d/ (Ray Serve, application %r)", args.host, args.port, APP_NAME)
        stop.wait()
        log.info("draining (up to %.0f s), then exiting", args.shutdown_timeout)
        draining = True
    finally:
        try:
            # One event loop for the handle and the shutdown: with Ray's throughput settings a handle routes on
            # the loop of whoever calls it.
            asyncio.run(_stop(APP_NAME, args.shutdown_timeout if draining else None, local))
        finally:
            ray.shutdown()


async def _stop(name: str, drain_timeout: float | None, local: bool) -> None:
    """Drain the ingress (when it got that far), then remove the application, or all of Serve if we started it."""
    import ray
    from ray import serve

    from cluster.replica import reports_actor

    if drain_timeout is not None:
        ingress = serve.get_app_handle(name)
        await asyncio.wait_for(ingress.drain.remote(drain_timeout), drain_timeout + 30)
    ray.kill(reports_actor(name))
    if local:
        await serve.shutdown_async()
    else:
        await asyncio.to_thread(serve.delete, name)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: exit now
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop
