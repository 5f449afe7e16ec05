"""Command line: ``python -m app --model M --host H --port P`` (flags: ``app/server/cli.py``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import sys

from app.server.app import create_app
from app.server.cli import clustered, engine_config, parse_args, server_config
from app.server.serve import serve
from app.server.state import server_state
from app.server.summary import startup_summary
from app.services.model_pool import LazyModel
from engine import chooser
from engine.chooser import ServedModel
from engine.core.architectures import NotServedNatively
from engine.core.config import EngineConfig


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if clustered(args):
        if importlib.util.find_spec("ray") is None:
            sys.exit("--replicas, --min-replicas and --ray-address run on Ray Serve, which is not installed: "
                     "pip install 'smolserve[cluster]' (ray[serve]).")  # fmt: skip
        from cluster.launch import run

        run(args)
        return
    config = engine_config(args)
    try:
        served = chooser.build(config)
    except NotServedNatively as exc:  # a start-up refusal is the user's answer, not a traceback
        sys.exit(f"cannot serve {args.model}: {exc}")
    first, *others = [lazy_model(names, source, config, served) for names, source in args.models]
    taken = [name for model in [first, *others] for name in model.names]
    if len(set(taken)) < len(taken):
        sys.exit(f"two chat models have the same name among {taken}: name them with --served-model-name")
    reload = first if others else None  # one chat model stays loaded
    app = create_app(served, server_config(args), lazy=others, reload=reload)
    summary = startup_summary(server_state(app), served.engine.runtime_info(), f"http://{args.host}:{args.port}")
    logging.getLogger("smolserve").info("%s", summary)
    serve(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)


def lazy_model(names: tuple[str, ...] | None, source: str, config: EngineConfig, first: ServedModel) -> LazyModel:
    """A chat model loaded when first asked for (or, the first, loaded again): built with the first's settings,
    without an embedding model, its steps on the first's engine thread."""
    own = dataclasses.replace(config, model=source, embedding_model="none")
    return LazyModel(names or (first.name if source == config.model else chooser.served_name(source),), source,
                     functools.partial(chooser.build, own, first.engine_thread),
                     chooser.context_length(source, config.max_model_len))  # fmt: skip


if __name__ == "__main__":
    main()
