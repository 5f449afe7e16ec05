"""Ollama's native API (``/api/*``) on the server's own port: its wire format (``request.py``: bodies and
``options`` onto the chat pipeline's fields; ``response.py``: its objects and newline-delimited JSON streams;
``models.py``: the model listings) and its routes (``api.py``), over the same model pipelines as ``/v1/*``. Errors
are Ollama's ``{"error": "..."}`` (``app/handlers.py``). Torch-free."""
