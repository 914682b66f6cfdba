"""`glassgpt view RUN_DIR`: serve a page that shows a trained run's insides in the browser.

The page and its API live in `glassgpt.view`; this module parses the flags, loads the run,
opens the socket (so a busy port is one clear error line) and serves until Ctrl+C.
"""

from __future__ import annotations

import argparse
import contextlib

from glassgpt.cli.common import add_checkpoint_flag, add_threads_flag, path_arg
from glassgpt.errors import CommandLineError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def register(subparsers: argparse._SubParsersAction) -> None:
    view = subparsers.add_parser(
        "view", help="look inside a trained run in the browser",
        description="Start a local web page over a trained run: the prompt's tokens, attention "
                    "per layer and head (weights or scores, every layer and head at once, a "
                    "head view), one token inside one head step by step, next-token top-k and "
                    "the logit lens at every position, ablation of heads and layers, streamed "
                    "sampling, sparse dictionaries' features (--sae), attribution graphs over "
                    "transcoders (--transcoders), what a fine-tune changed (--compare), and the "
                    "model card. Everything is served from this machine; nothing is fetched "
                    "from the internet.")
    view.add_argument("run_dir", type=path_arg, metavar="RUN_DIR", help="a trained run")
    view.add_argument("--port", type=int, default=DEFAULT_PORT,
                      help=f"port to listen on (default {DEFAULT_PORT}; 0 picks a free one)")
    view.add_argument("--host", default=DEFAULT_HOST,
                      help=f"address to listen on (default {DEFAULT_HOST}, this machine only; "
                           f"0.0.0.0 makes the page reachable from the network)")
    view.add_argument("--sae", type=path_arg, action="append", default=[], metavar="SAE",
                      help="a sparse dictionary (SAELens's format, glassgpt sae train) for the "
                           "Features panel; repeat for several")
    view.add_argument("--transcoders", type=path_arg, nargs="+", default=[], metavar="DIR",
                      help="transcoders, one a layer (glassgpt sae train --transcoder): their "
                           "directories, or one holding them, for the Graph panel (their "
                           "features join the Features panel)")
    view.add_argument("--compare", type=path_arg, default=None, metavar="RUN",
                      help="the run RUN_DIR was fine-tuned from (same shape and tokenizer), for "
                           "the Compare panel: what the tune changed, token by token and head "
                           "by head (its --checkpoint weights too)")
    view.add_argument("--any-run", action="store_true",
                      help="use dictionaries glassgpt trained on another run's model (neither "
                           "this run's directory nor its weights)")
    add_checkpoint_flag(view, "show")
    add_threads_flag(view)
    view.set_defaults(handler=run_view)


def run_view(args: argparse.Namespace) -> int:
    # Imported here: --help should not pay for torch, the model or the web framework.
    from glassgpt.interp.sae.provenance import check_trained_on
    from glassgpt.machine.devices import cpu_threads
    from glassgpt.rundir.checkpoint import describe_weights
    from glassgpt.view.compare import Comparison, load_comparison
    from glassgpt.view.features import load_dictionaries
    from glassgpt.view.graph import load_graphs
    from glassgpt.view.server import (
        allowed_hosts_for,
        create_app,
        load_for_view,
        make_server,
        open_socket,
        url_of,
    )

    if not 0 <= args.port <= 65535:
        raise CommandLineError(f"--port must be between 0 and 65535, got {args.port}")
    view = load_for_view(args.run_dir, checkpoint=args.checkpoint, threads=args.threads)
    dictionaries = load_dictionaries(view, args.sae)  # each refused in one line unless it fits
    graphs = load_graphs(view, args.transcoders, dictionaries)  # joins the Features panel
    if not args.any_run:  # the --sae and --transcoders dictionaries, by their names here
        check_trained_on(dictionaries.saes.items(), args.run_dir, args.checkpoint,
                         "train one on this run, or pass --any-run to use it")
    comparison = (Comparison(view, None) if args.compare is None
                  else load_comparison(view, args.compare, args.checkpoint))
    try:
        sock = open_socket(args.host, args.port)
    except OSError as error:
        reason = error.strerror or str(error)
        raise CommandLineError(f"cannot listen on {args.host}:{args.port} ({reason}); choose "
                               f"another --port or --host") from None
    app = create_app(view, allowed_hosts_for(args.host), dictionaries, graphs, comparison)
    c = view.model.config
    print(f"glassgpt view: {args.run_dir}, {describe_weights(args.run_dir, args.checkpoint)} "
          f"({c.n_layer} layers, {c.n_head} heads, context {c.block_size}, "
          f"{cpu_threads(view.threads)}) at "
          f"{url_of(sock)}  (Ctrl+C stops it)", flush=True)
    if allowed_hosts_for(args.host) == ("*",):
        print("note: listening on every network interface; anyone who can reach this machine "
              "can use the page", flush=True)
    with sock, contextlib.suppress(KeyboardInterrupt):
        # uvicorn stops on Ctrl+C, then raises it again for the caller: here it is the way to
        # stop the page, not an interruption.
        make_server(app).run(sockets=[sock])
    print("glassgpt view: stopped", flush=True)
    return 0
