"""What serves beneath the endpoints: the served models and their routing, the pool that loads and unloads them,
the embedding model, the backend that runs sequences (this process's scheduler or a cluster's replicas) and the
Batch API's runner. Torch-free."""
