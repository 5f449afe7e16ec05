"""The server as N engine replicas on Ray Serve: an ingress deployment runs the HTTP layer (``app/``) over a
``RayBackend``; each engine replica owns one engine and its scheduler; a prefix-affinity router sends a prompt to
the replica that already holds its longest prefix. Imported only with ``--replicas`` or ``--ray-address``."""

#: Ray Serve's throughput settings (user code on the replica's own event loop, gRPC between replicas, a frozen
#: garbage collector after start-up), without its direct-ingress ports; Serve's controller loop and metrics export
#: at 1 s instead of 0.1 s, and the dashboard agent's scans of every process at 60 s instead of 5 s (an idle
#: cluster's wake-ups slowed a server beside it by 9-14%; nothing here reads Ray's own metrics). Read when Ray
#: is imported, so they are set before the local Ray instance starts and in every replica's environment. Measured
#: in bench/README.md: on 2 cores every CPU cycle Ray spends is one the engine's step waits for.
RAY_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "METRICS_RECORD_INTERVAL_S": "60",
}
