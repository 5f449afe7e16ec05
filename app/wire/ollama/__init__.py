"""Ollama's native API (``/api/*``) on the server's own port, its wire format: ``request.py`` (bodies and ``options``
onto the chat pipeline's fields), ``response.py`` (its objects and newline-delimited JSON streams) and ``listings.py``
(the model listings). Its routes are ``app/api/ollama.py``, over the same model pipelines as ``/v1/*``. Errors are
Ollama's ``{"error": "..."}`` (``app/server/handlers.py``). Torch-free."""
