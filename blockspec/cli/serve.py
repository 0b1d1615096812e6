"""`blockspec serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one shared engine."""

from __future__ import annotations

import argparse
import os
import sys

from blockspec.cli.flags import add_llm_args, build_llm, model_source, report_llm

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
    p.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                   help="Host header names answered besides the loopback names and --host, comma-separated (*: any; "
                        "the port is ignored); other names get 400, against DNS rebinding")
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="request bodies over N bytes get 413 without being read (default: 4 MiB)")
    p.add_argument("--shutdown-grace", type=float, default=2.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, keep listening this long and answer new requests 503 while in-flight "
                        "ones are aborted, then exit; a second signal ends it at once (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import socket
    import time

    import uvicorn

    from blockspec.errors import BlockspecError
    from blockspec.server.app import build_app
    from blockspec.server.hosts import allowed_hosts

    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise BlockspecError(f"--max-request-bytes {args.max_request_bytes}: must be >= 1")
    if not 0 <= args.shutdown_grace < float("inf"):
        raise BlockspecError(f"--shutdown-grace {args.shutdown_grace}: must be a number of seconds >= 0")
    hosts = allowed_hosts(args.allowed_hosts, args.host)
    try:  # bind before loading the model: a busy port fails in a second, not after a minute of loading
        sock = socket.create_server((args.host, args.port))
    except (OSError, OverflowError) as e:
        raise BlockspecError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    llm = build_llm(args)
    report_llm(llm)
    # the source as given; for the bundled default its file name (clients type this name)
    name = args.served_model_name or model_source(args) or llm.lm.source.path.stem
    body_limit = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    app = build_app(llm.engine, name, args.api_key or os.environ.get(API_KEY_ENV) or None, allowed_hosts=hosts,
                    **body_limit)
    engine_loop = app.state.engine_loop

    class Server(uvicorn.Server):
        """uvicorn stops listening as soon as it is told to exit; this one first aborts in-flight work (so that
        streams end now, finish_reason "abort", instead of running to max_tokens) and answers 503 for the grace
        period, so that clients and load balancers see the documented refusal rather than a refused connection."""

        pending: tuple[int, float] | None = None  # (signal, when the grace ends)

        def handle_exit(self, sig: int, frame) -> None:
            engine_loop.begin_shutdown()
            if self.pending is None and not self.should_exit and args.shutdown_grace > 0:
                self.pending = (sig, time.monotonic() + args.shutdown_grace)
                return
            if self.pending is not None:  # a second signal: the grace ends now
                sig, self.pending = self.pending[0], None
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.pending is not None and time.monotonic() >= self.pending[1]:
                sig, self.pending = self.pending[0], None
                super().handle_exit(sig, None)
            return await super().on_tick(counter)

    host, port = sock.getsockname()[:2]
    print(f"blockspec: serving {name!r} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=10)
    Server(config).run(sockets=[sock])
    return 0
