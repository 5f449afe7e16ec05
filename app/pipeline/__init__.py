"""What every generating endpoint's pipeline is made of: the chat model (template, tools in its family's syntax,
grammars), one request's choices through the backend, a reply read as its family writes it (reasoning, tool
calls, harmony's channels) and the reply's budget. Torch-free."""
