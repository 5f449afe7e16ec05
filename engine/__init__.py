"""Scheduling and model execution. Only hf_engine, model_runner, kv_cache, attention, os_memory, sampler,
kernels and loader import torch."""
