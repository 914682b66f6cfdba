"""The web app of `glassgpt view`: one page and a JSON API over a `RunView` (Starlette).

    GET  /                 the page (HTML, CSS and JS ship in this package: no CDN)
    GET  /api/card         config, parameters by part, training curve, best val loss,
                           the sampling defaults the page's forms start from
    POST /api/tokenize     {prompt}                         -> tokens (id, text)
    POST /api/predictions  {prompt, k, temperature, top_k, top_p}
                           -> top-k per layer and position; what sampling draws from
    POST /api/attention    {prompt, layer, head|null, kind} -> one head or every head, weights
                           (after the softmax) or scores (before it)
    POST /api/overview     {prompt}                         -> every layer and head, small
    POST /api/attends      {prompt, position}               -> that token, every layer/head
    POST /api/head         {prompt, layer, head, position}  -> inside one head, step by step
    POST /api/ablate       {prompt, k, heads, attention, mlp} -> intact beside ablated
    POST /api/mlp          {prompt, layer, position}        -> inside the MLP, step by step
    POST /api/patching     {clean, corrupted|null, answer|null, wrong|null}
                           -> patching maps, layer x position and layer x head, 0..1, and
                           warnings when the corrupted prompt does not flip the answer
    GET  /api/progress     -> how far the running patching is: passes done of total, seconds
                           so far and an estimate of those left (the page polls it)
    POST /api/attribution  {prompt, position, token|null, against|null} -> each head's and
                           MLP's push on that token's logit (minus against's), adding up to it
    POST /api/sample       {prompt, max_new_tokens, temperature, top_k, top_p, seed}
                           -> server-sent events: token ..., then done (or error)
    GET  /api/timeline     -> the run's snapshot steps, and RUN/timeline.json's loss and head
                           scores at each (glassgpt.view.timeline); the requests above from
                           predictions to sample take `step` (null: the run's own weights) and
                           answer for the weights of that snapshot
    GET  /api/dictionaries -> the sparse dictionaries the view was started with (--sae)
    POST /api/features     {prompt, sae|null, k}            -> the top features at each position
    POST /api/feature      {sae|null, feature, prompt|null, position|null} -> a feature's top
                           contexts, density, logit effects, and its writers at that position
    POST /api/clamp        {prompt, sae|null, feature, value|null, scale|null, max_new_tokens,
                           temperature, top_k, top_p, seed} -> clamped beside untouched text
    GET  /api/graph/available -> whether the view has transcoders (--transcoders)
    POST /api/graph        {prompt, node_threshold, edge_threshold} -> the pruned attribution
                           graph (glassgpt.view.graph)
    POST /api/graph/edge   {prompt, source, target}        -> an edge's weight and its heads
    GET  /api/compare/available -> whether the view compares with a base run (--compare)
    POST /api/compare/tokens {prompt}                       -> each token's log-probability,
                           tuned, base and their difference (glassgpt.view.compare)
    POST /api/compare/changes {prompt}                      -> layer x head maps of how far
                           q, k, v, o and each head's output moved, and each MLP
    POST /api/compare/attention {prompt, layer, head}       -> the head's pattern before, after

A bad request gets a 4xx JSON `{"error": "one line"}`. The model runs off the event loop, on one
thread of its own: requests queue for it instead of stalling the server, and PyTorch keeps one
pool of compute threads (every thread that runs a parallel CPU op starts its own OpenMP pool,
and several such pools on a small CPU fight over its cores: requests got several times
slower). The server reads only the run directory it was started on (and the base run of
--compare): no request names a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from torch import nn

from glassgpt.config import SamplingConfig
from glassgpt.errors import GlassGPTError
from glassgpt.machine.devices import settle_threads
from glassgpt.model import count_parameters
from glassgpt.rundir.checkpoint import load_model
from glassgpt.view import compare, features
from glassgpt.view import requests as req
from glassgpt.view.compare import Comparison
from glassgpt.view.features import Dictionaries
from glassgpt.view.graph import EDGE, GRAPH, Graphs
from glassgpt.view.inspector import RunView
from glassgpt.view.progress import Progress
from glassgpt.view.timeline import Snapshots, timeline_answer

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# The page may load only what this server serves: no other site, no inline script.
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
log = logging.getLogger("glassgpt.view")
T = TypeVar("T")


PROBE_FLOPS = 1e10  # the most one timed pass of "auto" may cost (2 FLOPs a parameter a token)


def probe_tokens(model: nn.Module) -> int:
    """The prompt length "auto" times the thread counts on: 64 tokens (the page's unit of
    work), fewer for a model whose 64-token pass would cost more than PROBE_FLOPS (a 0.6B
    model: 8, so that the seven timed passes take a second or two, not six), never under 8."""
    fits = int(PROBE_FLOPS // (2 * max(count_parameters(model), 1)))
    return max(1, min(64, model.config.block_size, max(8, fits)))


def load_for_view(run_dir: str | Path, device: str | torch.device = "cpu",
                  checkpoint: str = "best", threads: int | str | None = None) -> RunView:
    """The run that `glassgpt view` shows: its best weights by default, or its last.

    `threads` (a count, "auto" or None: glassgpt.machine.threadsetting) is the CPU's thread count;
    "auto" times a forward over a prompt of up to 64 tokens (`probe_tokens`), the page's unit
    of work, and keeps the faster count; it reads out the last position only (the blocks are
    what is timed: a 151,936-word head over 64 positions made each of the seven timed passes
    20 GFLOP more). The view's `threads` is the count it serves with."""
    run_dir = Path(run_dir)
    model, tokenizer = load_model(run_dir, device, checkpoint=checkpoint)
    model.eval()
    on = model.lm_head.weight.device
    prompt = torch.arange(probe_tokens(model), device=on)[None, :] \
        % model.config.vocab_size  # (1, T)
    with torch.no_grad():
        chosen = settle_threads(threads, on, lambda: model(prompt, last_only=True))
    return RunView(model, tokenizer, run_dir, threads=chosen, checkpoint=checkpoint)


# --- the app -------------------------------------------------------------------------------

def create_app(view: RunView, allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES,
               dictionaries: Dictionaries | None = None, graphs: Graphs | None = None,
               comparison: Comparison | None = None) -> Starlette:
    """The Starlette app serving `view`. `allowed_hosts`: the Host names it answers (a page on
    another site that rebinds its name to 127.0.0.1 is refused); ("*",) answers any.
    `dictionaries`: the sparse dictionaries of the Features panel (`features.load_dictionaries`);
    `graphs`: the transcoders of the Graph panel (`graph.load_graphs`); `comparison`: the base
    run of the Compare panel (`compare.load_comparison`)."""
    api = Api(view, dictionaries or Dictionaries(view, {}), graphs or Graphs(view, [], {}),
              comparison or Comparison(view, None))
    routes = [
        Route("/", api.page),
        Route("/api/card", api.card),
        Route("/api/tokenize", api.tokenize, methods=["POST"]),
        Route("/api/predictions", api.predictions, methods=["POST"]),
        Route("/api/attention", api.attention, methods=["POST"]),
        Route("/api/overview", api.overview, methods=["POST"]),
        Route("/api/attends", api.attends, methods=["POST"]),
        Route("/api/head", api.head, methods=["POST"]),
        Route("/api/ablate", api.ablate, methods=["POST"]),
        Route("/api/mlp", api.mlp, methods=["POST"]),
        Route("/api/patching", api.patching, methods=["POST"]),
        Route("/api/progress", api.progress_answer),
        Route("/api/attribution", api.attribution, methods=["POST"]),
        Route("/api/sample", api.sample, methods=["POST"]),
        Route("/api/timeline", api.timeline),
        Route("/api/dictionaries", api.dictionaries),
        Route("/api/features", api.top_features, methods=["POST"]),
        Route("/api/feature", api.feature, methods=["POST"]),
        Route("/api/clamp", api.clamp, methods=["POST"]),
        Route("/api/graph/available", api.graph_available),
        Route("/api/graph", api.graph, methods=["POST"]),
        Route("/api/graph/edge", api.graph_edge, methods=["POST"]),
        Route("/api/compare/available", api.compare_available),
        Route("/api/compare/tokens", api.compare_tokens, methods=["POST"]),
        Route("/api/compare/changes", api.compare_changes, methods=["POST"]),
        Route("/api/compare/attention", api.compare_attention, methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("glassgpt.view", "static")]), name="static"),
    ]
    handlers = {HTTPException: http_error, GlassGPTError: user_error,
                ClientDisconnect: client_gone, Exception: server_error}
    middleware = [Middleware(HostCheck, allowed=allowed_hosts)]
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)


def host_name(host_header: str) -> str | None:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "a:80" -> "a";
    None when it is not `name` or `name:digits` ("127.0.0.1:evil", "[::1]evil.example"), or
    holds a character that is not ASCII (a name beyond ASCII travels as punycode, "xn--...")."""
    if not host_header.isascii():
        return None
    if host_header.startswith("["):
        name, _, rest = host_header[1:].partition("]")
    else:
        name, _, port = host_header.partition(":")
        rest = f":{port}" if port or host_header.endswith(":") else ""
    if rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit()):
        return None
    return name.lower() if name else None


def origin_netloc(origin: str) -> str | None:
    """"http://127.0.0.1:8000" -> "127.0.0.1:8000"; None for anything else ("null", https)."""
    scheme, sep, netloc = origin.partition("://")
    if scheme.lower() != "http" or not sep or not netloc or "/" in netloc:
        return None
    return netloc.lower()


class HostCheck:
    """Answer only requests whose Host is one of `allowed` ("*": any). A site that points its
    own name at 127.0.0.1 (DNS rebinding) sends its name, not ours, and is refused.

    A POST that names an Origin must come from this server's own page (the Origin's host and
    port are the Host's): a page of another site cannot drive the model, even with a request
    that a browser lets through. Tools that send no Origin (curl, the bench) are answered.
    """

    def __init__(self, app: Any, allowed: tuple[str, ...]):
        self.app, self.allowed = app, {name.lower() for name in allowed}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await error_response(*refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Any) -> tuple[str, int] | None:
        """Why this request is refused (message, status), or None to answer it.

        Every Host and Origin header is read, not one of them: a request with two Origins, a
        stranger's and ours, was answered when only the last was checked. Two Host headers
        are no request at all (RFC 9110): refused."""
        hosts = header_values(scope, b"host")
        host = hosts[0] if len(hosts) == 1 else ""
        name = host_name(host)
        if name is None or ("*" not in self.allowed and name not in self.allowed):
            return (f"this server answers requests for {', '.join(sorted(self.allowed))} "
                    f"only", 400)
        posted = scope["method"] not in ("GET", "HEAD")
        strangers = [origin for origin in header_values(scope, b"origin")
                     if origin_netloc(origin) != host.lower()]
        if posted and strangers:
            return ("this server answers POST requests from its own page only (Origin "
                    f"{strangers[0][:60]!r} is not http://{host})", 403)
        return None


def header_values(scope: Any, name: bytes) -> list[str]:
    """Every value of the header `name` (lower case, as ASGI servers give names) in the
    request, in order; as latin-1 text, which any byte decodes to, so no header raises."""
    return [value.decode("latin-1") for key, value in scope["headers"] if key.lower() == name]


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": req.one_line(message)}, status_code=status)


async def user_error(request: Request, error: Exception) -> Response:
    return error_response(str(error), getattr(error, "status", 400))


async def http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = {404: f"nothing at {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(message.get(error.status_code, error.detail), error.status_code)


async def client_gone(request: Request, error: Exception) -> Response:
    """The client closed the connection before its request was read: nobody is left to answer,
    and it is no error of the server's (one line in the log at debug level, no traceback)."""
    log.debug("glassgpt view: the client left before sending %s", request.url.path)
    return error_response("the client closed the connection", 400)


async def server_error(request: Request, error: Exception) -> Response:
    log.exception("glassgpt view: error answering %s", request.url.path)
    return error_response(f"internal error ({type(error).__name__}); see the server's log", 500)


class Api:
    """The endpoints: parse the request, run `RunView` on the model thread, answer JSON."""

    def __init__(self, view: RunView, dictionaries: Dictionaries, graphs: Graphs,
                 comparison: Comparison):
        self.view, self.dicts, self.graphs = view, dictionaries, graphs
        self.comparison = comparison
        self.snapshots = Snapshots(view)  # the Timeline's steps, a model each, a few kept
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glassgpt-model")
        self.page_html = resources.files("glassgpt.view").joinpath("static/index.html") \
            .read_text("utf-8")
        # Decoding engines keep one KV cache on the model: one sample streams at a time, and
        # the next waits for it (a page that stops a stream frees it within a token).
        self.sampling = asyncio.Lock()
        self.progress = Progress()  # of the long request on the model thread

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.page_html, headers=SECURITY_HEADERS)

    async def on_model_thread(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, function,
                                                                *args)

    async def card(self, request: Request) -> Response:
        card = await self.on_model_thread(self.view.card)
        return JSONResponse({**card, "sampling": page_sampling_defaults()})

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, req.TOKENIZE, self.view.tokens)

    async def predictions(self, request: Request) -> Response:
        return await self._at_step(request, req.PREDICTIONS, RunView.predictions)

    async def attention(self, request: Request) -> Response:
        return await self._at_step(request, req.ATTENTION, RunView.attention)

    async def overview(self, request: Request) -> Response:
        return await self._at_step(request, req.OVERVIEW, RunView.overview)

    async def attends(self, request: Request) -> Response:
        return await self._at_step(request, req.ATTENDS, RunView.attends)

    async def head(self, request: Request) -> Response:
        return await self._at_step(request, req.HEAD, RunView.head)

    async def ablate(self, request: Request) -> Response:
        return await self._at_step(request, req.ABLATE, RunView.ablate)

    async def mlp(self, request: Request) -> Response:
        return await self._at_step(request, req.MLP, RunView.mlp)

    async def patching(self, request: Request) -> Response:
        report = self.progress.reporter("patching")
        return await self._at_step(request, req.PATCHING, lambda view, **values:
                                   view.patching(**values, progress=report))

    async def progress_answer(self, request: Request) -> Response:
        """Off the model thread: it is busy with the request this asks about."""
        return JSONResponse(self.progress.answer(), headers={"Cache-Control": "no-store"})

    async def attribution(self, request: Request) -> Response:
        return await self._at_step(request, req.ATTRIBUTION, RunView.attribution)

    async def timeline(self, request: Request) -> Response:
        return JSONResponse(await self.on_model_thread(timeline_answer, self.snapshots))

    async def dictionaries(self, request: Request) -> Response:
        return JSONResponse({"dictionaries": self.dicts.listing()})

    async def top_features(self, request: Request) -> Response:
        return await self._answer(request, req.FEATURES,
                                  partial(features.top_features, self.view, self.dicts))

    async def feature(self, request: Request) -> Response:
        return await self._answer(request, req.FEATURE,
                                  partial(features.feature, self.view, self.dicts))

    async def clamp(self, request: Request) -> Response:
        values = await read_fields(request, req.CLAMP)
        edit = {name: values.pop(name) for name in ("prompt", "sae", "feature", "value", "scale")}
        sampling = SamplingConfig(**values)  # checked here: a mistake is a 400
        # Decoding keeps its KV cache on the model: a clamp waits for a running sample.
        async with self.sampling:
            answer = await self.on_model_thread(
                lambda: features.clamp(self.view, self.dicts, sampling=sampling, **edit))
        return JSONResponse(answer)

    async def graph_available(self, request: Request) -> Response:
        return JSONResponse(self.graphs.available())

    async def graph(self, request: Request) -> Response:
        return await self._answer(request, GRAPH, self.graphs.graph)

    async def graph_edge(self, request: Request) -> Response:
        return await self._answer(request, EDGE, self.graphs.edge)

    async def compare_available(self, request: Request) -> Response:
        return JSONResponse(self.comparison.available())

    async def compare_tokens(self, request: Request) -> Response:
        return await self._answer(request, compare.TOKENS, self.comparison.tokens)

    async def compare_changes(self, request: Request) -> Response:
        return await self._answer(request, compare.CHANGES, self.comparison.changes)

    async def compare_attention(self, request: Request) -> Response:
        return await self._answer(request, compare.PATTERNS, self.comparison.attention)

    async def _answer(self, request: Request, fields: dict[str, req.Field],
                      compute: Callable[..., dict[str, Any]]) -> Response:
        values = await read_fields(request, fields)
        return JSONResponse(await self.on_model_thread(lambda: compute(**values)))

    async def _at_step(self, request: Request, fields: dict[str, req.Field],
                       compute: Callable[..., dict[str, Any]]) -> Response:
        """`compute(view, **values)` on the view of the request's `step` (the Timeline's
        slider; null: the run's own weights), loaded on the model thread when it is not kept."""
        values = await read_fields(request, req.at_step(fields))
        step = values.pop("step")
        return JSONResponse(await self.on_model_thread(
            lambda: compute(self.snapshots.view_at(step), **values)))

    async def sample(self, request: Request) -> Response:
        values = await read_fields(request, req.at_step(req.SAMPLE))
        prompt, step = values.pop("prompt"), values.pop("step")
        # Settings and prompt are checked here, so a mistake is a 400, not a broken stream.
        sampling = SamplingConfig(**values)
        pieces = await self.on_model_thread(
            lambda: self.snapshots.view_at(step).sample(prompt, sampling))
        return StreamingResponse(self._events(pieces), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def _events(self, pieces: Iterator[str]) -> AsyncIterator[str]:
        """Each piece of text as a `token` event, then `done` (or `error`)."""
        done = object()
        count, started = 0, time.perf_counter()
        try:
            async with self.sampling:
                while (piece := await self.on_model_thread(next, pieces, done)) is not done:
                    count += 1
                    yield sse_event("token", {"text": piece})
                yield sse_event("done", {"pieces": count,
                                         "seconds": round(time.perf_counter() - started, 3)})
        except GlassGPTError as error:
            yield sse_event("error", {"error": req.one_line(error)})
        except Exception as error:  # every failure reaches the page, as an event
            # The 200 and the first events are already sent: an `error` event is the only way
            # left to tell the page. One line in the log; the traceback at debug level.
            log.error("glassgpt view: sampling failed: %s: %s", type(error).__name__,
                      req.one_line(error))
            log.debug("glassgpt view: sampling failed", exc_info=True)
            yield sse_event("error", {"error": f"sampling failed ({type(error).__name__}: "
                                               f"{req.one_line(error)[:200]})"})
        finally:
            # Ends decoding and frees the KV cache. On the model thread, after the step that may
            # still be running there when a page that went away cancelled this stream.
            self.model_thread.submit(pieces.close)  # type: ignore[attr-defined]


def page_sampling_defaults() -> dict[str, dict[str, Any]]:
    """What the page's forms start from, as the server fills a request in: the next-token bars
    (`predictions`) and the Sampling panel (`sample`), from glassgpt.config's one table."""
    return {form: {name: field.default for name, field in fields.items() if name != "prompt"}
            for form, fields in (("predictions", req.FILTER), ("sample", req.SAMPLE))}


async def read_fields(request: Request, fields: dict[str, req.Field]) -> dict[str, Any]:
    body = await req.read_body(request.stream())
    data = req.parse_json_object(body, request.headers.get("content-type"))
    return req.take_fields(data, fields)


def sse_event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event; JSON keeps any newline of the text inside one `data:` line."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


# --- serving -------------------------------------------------------------------------------

def allowed_hosts_for(host: str) -> tuple[str, ...]:
    """The Host names to answer when listening on `host`: any name when listening on every
    interface (the user chose to be reachable), else the loopback names and `host` itself."""
    if host in ("0.0.0.0", "::", ""):
        return ("*",)
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, host)))


def open_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one). Raises OSError (in use,
    no such address)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def make_server(app: Starlette, log_level: str = "warning") -> Any:
    """A uvicorn server for `app`; `server.run(sockets=[sock])` serves until Ctrl+C (or until
    `server.should_exit` is set from another thread)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    return uvicorn.Server(config)
