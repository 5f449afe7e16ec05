"""The server as N engine replicas on Ray Serve: an ingress deployment runs the HTTP layer (``app/``) over a
``RayBackend``; each engine replica owns one engine and its scheduler; a prefix-affinity router sends a prompt to
the replica that already holds its longest prefix. Imported only with ``--replicas`` or ``--ray-address``."""

#: Ray Serve's throughput settings (user code on the replica's own event loop, gRPC between replicas, a frozen
#: garbage collector after start-up), without its direct-ingress ports. Read when Ray is imported, so they are set
#: before the local Ray instance starts and in every replica's environment. Measured in bench/README.md: on 2
#: cores every CPU cycle Ray spends is one the engine's step waits for.
RAY_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
