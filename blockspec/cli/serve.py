"""`blockspec serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one shared engine."""

from __future__ import annotations

import argparse
import os
import sys

from blockspec.cli.flags import add_llm_args, build_llm, model_source

API_KEY_ENV = "BLOCKSPEC_API_KEY"


def add_args(p: argparse.ArgumentParser) -> None:
    add_llm_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model source as given; for the bundled "
                        "default its file name, SmolLM2-135M-Instruct.Q4_1)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV} if set)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from blockspec.errors import BlockspecError
    from blockspec.server.app import build_app

    try:  # bind before loading the model: a busy port fails in a second, not after a minute of loading
        sock = socket.create_server((args.host, args.port))
    except (OSError, OverflowError) as e:
        raise BlockspecError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    llm = build_llm(args)
    # the source as given; for the bundled default its file name (clients type this name)
    name = args.served_model_name or model_source(args) or llm.lm.source.path.stem
    app = build_app(llm.engine, name, args.api_key or os.environ.get(API_KEY_ENV) or None)
    engine_loop = app.state.engine_loop

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # uvicorn waits for open connections before the lifespan ends: abort in-flight work first, so that
            # streams end now (finish_reason "abort") instead of running to max_tokens
            engine_loop.begin_shutdown()
            super().handle_exit(sig, frame)

    host, port = sock.getsockname()[:2]
    print(f"blockspec: serving {name!r} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=10)
    Server(config).run(sockets=[sock])
    return 0
