"""The HTTP server: the OpenAI wire format (``openai/``) over the scheduler. Never imports torch."""
