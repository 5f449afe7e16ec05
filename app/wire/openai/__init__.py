"""The OpenAI wire format, one module per endpoint family: ``completions``, ``chat``, ``responses``, ``embeddings``,
``model_list``; what they share: ``request`` (parsing bodies), ``sampling`` (generation fields and their rules),
``messages`` (chat's parts), ``choices`` (choices, logprob strings, envelopes, usage), ``errors`` (the error
envelope)."""
