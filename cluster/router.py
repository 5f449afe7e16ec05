"""The Ray Serve request router of the engine deployment: ``routing.PrefixAffinity`` over Ray's replica set and
its queue-length probes. Configured by ``cluster.deployments`` as ``cluster.router:PrefixAffinityRouter``."""

from __future__ import annotations

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from app.services.backend import Submission
from cluster.routing import PrefixAffinity
from engine.core.block_pool import prefix_hashes

#: A prompt's first blocks decide its route; hashing a 100k-token prompt whole would cost milliseconds for
#: nothing (a shared preamble is what routing looks for).
MAX_ROUTED_BLOCKS = 256


class PrefixAffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, imbalance: int = 4, block_size: int = 16) -> None:
        self._policy = PrefixAffinity(imbalance)
        self._block_size = block_size

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hashes, key = self._hashes(pending_request), _cache_key(pending_request)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self._replica_queue_len_cache
        loads = {name: cache.get(r.replica_id) or 0 for name, r in by_name.items()}
        return [[by_name[name] for name in rank] for rank in self._policy.choose(hashes, loads, key)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        self._policy.record(replica_id.unique_id, self._hashes(pending_request), _cache_key(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._policy.keep_only({r.replica_id.unique_id for r in replicas})

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The prompt's leading block hashes; none for calls that are not a generation (metrics, info)."""
        if pending_request is None or not pending_request.args:
            return []
        submission = pending_request.args[0]
        if not isinstance(submission, Submission):
            return []
        prompt = submission.request.prompt_ids[: MAX_ROUTED_BLOCKS * self._block_size]
        return prefix_hashes(prompt, self._block_size)


def _cache_key(pending_request: PendingRequest | None) -> str | None:
    """The client's cache key, for a generation that has one."""
    submission = pending_request.args[0] if pending_request is not None and pending_request.args else None
    return submission.cache_key if isinstance(submission, Submission) else None
