"""HTTP layer: the OpenAI wire format over the scheduler. Never imports torch."""
