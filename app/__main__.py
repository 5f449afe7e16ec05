"""Command line: ``python -m app --model M --host H --port P`` (flags: ``app/cli.py``)."""

from __future__ import annotations

import importlib.util
import logging
import sys

from app.cli import clustered, engine_config, parse_args, server_config
from app.serve import serve
from app.server import create_app
from app.state import server_state
from app.summary import startup_summary
from engine import chooser
from engine.core.architectures import NotServedNatively


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
    try:
        served = chooser.build(engine_config(args))
    except NotServedNatively as exc:  # a start-up refusal is the user's answer, not a traceback
        sys.exit(f"cannot serve {args.model}: {exc}")
    app = create_app(served, server_config(args))
    summary = startup_summary(server_state(app), served.engine.runtime_info(), f"http://{args.host}:{args.port}")
    logging.getLogger("smolserve").info("%s", summary)
    serve(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)


if __name__ == "__main__":
    main()
