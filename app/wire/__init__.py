"""The wire formats, one package per API maker: OpenAI's (``openai/``), Anthropic's (``anthropic/``) and
Ollama's (``ollama/``): bodies parsed and checked as their makers check them, answers and stream events shaped as
they shape them. No routes here. Torch-free."""
