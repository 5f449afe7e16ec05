"""The server as N engine replicas on Ray Serve: an ingress deployment runs the HTTP layer (``app/``) over a
``RayBackend``; each engine replica owns one engine and its scheduler; a prefix-affinity router sends a prompt to
the replica that already holds its longest prefix. Imported only with ``--replicas`` or ``--ray-address``."""
