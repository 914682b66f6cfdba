"""How fast `glassgpt view` answers: `python -m glassgpt.bench.view [RUN_DIR]`.

A benchmark, not a test: it starts the real server (uvicorn on 127.0.0.1, a free port) and
times each API request over HTTP, as the page sends them, for prompts of `--prompt-chars`
characters of Tiny Shakespeare. Without RUN_DIR it measures a randomly initialised model of the
`shakespeare-char` shape (6 layers, 6 heads, width 384, context 256, vocabulary 65): speed does
not depend on what the weights learned.

"cold" is a prompt the server has not seen (the forward pass runs), "warm" one it has (switching
layer or head on the page). Each prompt is a different window of the text, so every cold
request really is one. The sample line is the time to the first streamed token and the rate of
the rest. A RUN_DIR with snapshots (`train --snapshots N`) also times the Timeline's slider:
the page's requests at a snapshot not loaded yet, then at one kept.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from glassgpt.config import GPTConfig, sampling_defaults
from glassgpt.data import tinyshakespeare
from glassgpt.model import GPT
from glassgpt.rundir.snapshots import list_snapshots
from glassgpt.tokenizers import CharTokenizer
from glassgpt.view.inspector import RunView
from glassgpt.view.server import create_app, load_for_view, make_server, open_socket, url_of

BUDGET_MS = 300.0
# What the page sends when the prompt changes: (path, body, whether it names the position).
PAGE_REQUESTS = [("api/attention", {"layer": 0}, False), ("api/predictions", {"k": 5}, False),
                 ("api/attends", {}, True), ("api/overview", {}, False),
                 ("api/head", {"layer": 0, "head": 0}, True),
                 ("api/ablate", {"k": 5}, False)]


def shakespeare_text() -> str:
    """Tiny Shakespeare as text (the packaged copy unless the environment names another)."""
    data, _ = tinyshakespeare()
    return data.decode("utf-8")


def random_shakespeare_char(text: str) -> RunView:
    """A randomly initialised `shakespeare-char` model with the character vocabulary of `text`."""
    tokenizer = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    config = GPTConfig.from_preset("shakespeare-char", vocab_size=tokenizer.vocab_size)
    return RunView(GPT(config).eval(), tokenizer, name="shakespeare-char (random weights)")


class Client:
    """POSTs JSON to the server and times the whole answer (headers and body)."""

    def __init__(self, url: str):
        self.url = url

    def post(self, path: str, body: dict[str, Any]) -> tuple[float, bytes]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read()
        return (time.perf_counter() - started) * 1000, data

    def get(self, path: str) -> tuple[float, bytes]:
        started = time.perf_counter()
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            data = response.read()
        return (time.perf_counter() - started) * 1000, data

    def first_token_and_rate(self, body: dict[str, Any]) -> tuple[float, float]:
        """Milliseconds to the first `token` event, and tokens (events) per second after it."""
        request = urllib.request.Request(self.url + "api/sample", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        first, tokens = None, 0
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"event: token"):
                    tokens += 1
                    if first is None:
                        first = time.perf_counter()
        end = time.perf_counter()
        if first is None:
            raise RuntimeError("the sample streamed no token")
        rate = (tokens - 1) / (end - first) if tokens > 1 and end > first else float("nan")
        return (first - started) * 1000, rate


def measure(view: RunView, client: Client, prompts: list[str]) -> dict[str, list[float]]:
    """Milliseconds per request kind, one value per prompt."""
    L, T = view.model.config.n_layer, len(view.encode(prompts[0]).ids)
    times: dict[str, list[float]] = {}

    def timed(name: str, call: Callable[[], tuple[float, bytes]]) -> None:
        times.setdefault(name, []).append(call()[0])

    timed("card (first)", lambda: client.get("api/card"))
    for prompt in prompts:
        timed("tokenize", lambda p=prompt: client.post("api/tokenize", {"prompt": p}))
        view.traces.entries.clear()
        timed("attention, all heads (cold)",
              lambda p=prompt: client.post("api/attention", {"prompt": p, "layer": 0}))
        view.traces.entries.clear()
        timed("predictions + logit lens, k=5 (cold)",
              lambda p=prompt: client.post("api/predictions", {"prompt": p, "k": 5}))
        timed("predictions + logit lens, k=5 (warm)",
              lambda p=prompt: client.post("api/predictions", {"prompt": p, "k": 5}))
        timed("attention, all heads (warm)",
              lambda p=prompt: client.post("api/attention", {"prompt": p, "layer": L - 1}))
        timed("attention, one head (warm)",
              lambda p=prompt: client.post("api/attention",
                                           {"prompt": p, "layer": L - 1, "head": 0}))
        timed("attends, last token (warm)",
              lambda p=prompt: client.post("api/attends", {"prompt": p, "position": T - 1}))
        timed("scores, all heads (warm)",
              lambda p=prompt: client.post("api/attention", {"prompt": p, "layer": L - 1,
                                                             "kind": "scores"}))
        timed("every layer and head (warm)",
              lambda p=prompt: client.post("api/overview", {"prompt": p}))
        timed("inside one head, last token (warm)",
              lambda p=prompt: client.post("api/head", {"prompt": p, "layer": L - 1,
                                                        "head": 0, "position": T - 1}))
        timed("ablation, one head (cold)",
              lambda p=prompt: client.post("api/ablate", {"prompt": p, "k": 5,
                                                          "heads": [[0, 0]]}))
        timed("predictions, T 0.7 top-k 10 (warm)",
              lambda p=prompt: client.post("api/predictions", {"prompt": p, "k": 5,
                                                               "temperature": 0.7,
                                                               "top_k": 10}))
        timed("card", lambda: client.get("api/card"))
        view.traces.entries.clear()
        timed(f"page update: the {len(PAGE_REQUESTS)} requests at once (cold)",
              lambda p=prompt: page_update(client, p, T - 1))
    return times


def measure_steps(view: RunView, client: Client, prompts: list[str]
                  ) -> dict[str, list[float]]:
    """The Timeline's slider (a run with snapshots): what the page sends when it is let go at
    a snapshot not loaded yet (the weights read, the head scores of its badges and one forward
    pass), then for another prompt at that step (its model kept)."""
    steps = list_snapshots(view.run_dir) if view.run_dir is not None else []
    T = len(view.encode(prompts[0]).ids)
    times: dict[str, list[float]] = {}
    for step, prompt, other in zip(steps, prompts, prompts[1:], strict=False):
        times.setdefault("step: page update at a new snapshot", []).append(
            page_update(client, prompt, T - 1, step)[0])
        times.setdefault("step: page update, its model kept (cold)", []).append(
            page_update(client, other, T - 1, step)[0])
    return times


def page_update(client: Client, prompt: str, position: int, step: int | None = None
                ) -> tuple[float, bytes]:
    """What the page sends when the prompt changes (or the Timeline's step), all at once: the
    time until the last answer is in."""
    at_step = {} if step is None else {"step": step}
    requests = [(path, {"prompt": prompt, **body, **({"position": position} if at else {}),
                        **at_step}) for path, body, at in PAGE_REQUESTS]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(lambda r: client.post(*r), requests))
    return (time.perf_counter() - started) * 1000, b""


def cpu_description() -> str:
    """The CPU's model name and its vector flags (from /proc/cpuinfo where there is one)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first core's values
    flags = fields.get("flags", "").split()
    vector = [f for f in flags if f.startswith(("avx", "fma", "sse4", "amx"))]
    cores = sum(1 for line in info.splitlines() if line.startswith("processor"))
    return f"{fields.get('model name', '?')}, {cores} logical cores, flags: {' '.join(vector)}"


def measure_sampling(client: Client, prompts: list[str], tokens: int,
                     block_size: int) -> dict[str, list[float]]:
    """Time to the first token after a full prompt, and the streaming rate from a prompt short
    enough that the continuation stays in the context (past it, every step recomputes the
    whole window: learned positions cannot slide)."""
    view = sampling_defaults("view")  # what the page sends
    settings = {"temperature": view.temperature, "top_k": view.top_k, "seed": view.seed}
    first = [client.first_token_and_rate({"prompt": p, "max_new_tokens": 1, **settings})[0]
             for p in prompts]
    short = max(1, block_size - tokens)
    rates = [client.first_token_and_rate({"prompt": p[:short], "max_new_tokens": tokens,
                                          **settings})[1] for p in prompts[:3]]
    return {"first": first, "rate": rates}


def report(view: RunView, times: dict[str, list[float]], sample: dict[str, list[float]],
           prompt_chars: int) -> bool:
    c = view.model.config
    print(f"glassgpt view bench: {view.name}: {c.n_layer} layers, {c.n_head} heads, width "
          f"{c.n_embd}, context {c.block_size}, vocab {c.vocab_size}")
    print(f"cpu: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; prompt {prompt_chars} characters; {len(times['tokenize'])} prompts")
    print(f"{'request':<44} {'median ms':>10} {'max ms':>10}")
    worst = 0.0
    for name, values in times.items():
        print(f"{name:<44} {statistics.median(values):>10.1f} {max(values):>10.1f}")
        worst = max(worst, statistics.median(values))
    first, rates = sample["first"], sample["rate"]
    print(f"{'sample: first token':<44} {statistics.median(first):>10.1f} {max(first):>10.1f}")
    print(f"sample: then {statistics.median(rates):.0f} tokens/s streamed (median of "
          f"{len(rates)}, prompts that leave room in the context)")
    worst = max(worst, statistics.median(first))
    within = worst < BUDGET_MS
    verdict = "within" if within else "OVER"
    print(f"slowest median {worst:.1f} ms: {verdict} the {BUDGET_MS:.0f} ms budget")
    return within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glassgpt.bench.view",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", type=Path,
                        help="a trained run (default: a random shakespeare-char model)")
    parser.add_argument("--prompt-chars", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10, help="prompts to time")
    parser.add_argument("--sample-tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    text = shakespeare_text()
    view = load_for_view(args.run_dir) if args.run_dir else random_shakespeare_char(text)
    # A token holds at least one character: a prompt of block_size characters always fits.
    chars = min(args.prompt_chars, view.block_size)
    prompts = [text[i * 1000:i * 1000 + chars] for i in range(args.repeats)]
    sock = open_socket("127.0.0.1", 0)
    server = make_server(create_app(view))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        client = Client(url_of(sock))
        client.post("api/predictions", {"prompt": prompts[0], "k": 5})  # warm-up: not timed
        times = measure(view, client, prompts)
        times |= measure_steps(view, client, prompts)
        sample = measure_sampling(client, prompts, args.sample_tokens, view.block_size)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    return 0 if report(view, times, sample, chars) else 1


if __name__ == "__main__":
    raise SystemExit(main())
