"""The server itself: the command line, the Starlette app and its lifecycle, the route table and the server's own
routes, what every request goes through (limits, browsers kept out, the API key, the access log, error envelopes,
metrics) and the state the endpoints share. Torch-free."""
