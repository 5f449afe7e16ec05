"""The torch runtime: the batch engine that carries out the planner's steps, the model runner, attention, KV storage,
block tables, the sampler, loading, weights and the native kernels (``csrc/``)."""
