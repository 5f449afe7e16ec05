"""Anthropic's Messages API wire format (``POST /v1/messages``, ``/v1/messages/count_tokens``): its request body and how
it becomes the conversation the chat pipeline runs (``request.py``), its message and stream events (``response.py``),
its error envelope (``errors.py``). The pipeline itself is ``app/api/anthropic_messages.py``. Torch-free."""
