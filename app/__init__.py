"""The HTTP server: the server itself (`server/`), the wire formats (`wire/`), each API's routes and pipelines
(`api/`), the pieces of a generating pipeline (`pipeline/`), the services beneath them (`services/`) and what is
kept (`stores/`), over the scheduler. Never imports torch."""
