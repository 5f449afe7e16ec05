"""Scheduling and model execution. Only hf_engine, kv_cache and loader import torch."""
