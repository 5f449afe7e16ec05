"""gpt-oss's harmony format, through OpenAI's own ``openai-harmony`` library (never hand-written): the prompt
rendered as harmony's ``Conversation`` (``prompt.py``), the reply read by its ``StreamableParser`` (``reader.py``),
the grammars that hold a reply to harmony's shape where the request constrains it (``grammar.py``), and the encoding
loaded from the model's own vocabulary (``encoding.py``). Torch-free.

A harmony reply is a run of messages, each on a channel: ``analysis`` (the reasoning: ``reasoning_content``,
Responses reasoning items, Anthropic thinking blocks), ``commentary`` (a call when addressed ``to=functions.NAME``:
``tool_calls`` on every API; else a preamble, content), and ``final`` (the answer: content). ``<|return|>`` ends
the reply, ``<|call|>`` ends it on a call.
"""
