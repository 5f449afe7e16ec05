"""The torch-free engine core: the seam, the configuration, the scheduler loop and the planner, block accounting and
the prefix cache, request streams, grammars, tokenizers, the fake engine. Nothing here imports torch
(``tests/test_imports.py``)."""
