"""Circuits with gradients, timed: an attribution graph, and patching every head by gradient
against patching it by forward runs.

`bench_graph(size)` builds a model of random weights (n_layer blocks, width n_embd) and a
ReLU transcoder of expansion x n_embd latents for each MLP, its encoder biased so that about
`active` latents fire on a token (real transcoders fire sparsely; how many fire decides the
graph's size), and a prompt of `prompt_len` random ids. It times, in interleaved rounds:

  * the attribution graph of the prompt (glassgpt.interp.graph.attribution_graph), and,
    given the python of a venv with circuit-tracer (`circuit_tracer_python`, or
    $GLASSGPT_CIRCUIT_TRACER_PYTHON), circuit-tracer's `attribute` on the same weights in a
    process of its own (circuit_tracer_worker.py; the model exported as TransformerLens's
    checkpoint), its adjacency compared with glassgpt's
  * attribution patching of every head (get_attr_patch_attn_head_out_all_pos: one forward
    and one backward of the corrupted prompt) beside activation patching of every head
    (get_act_patch_attn_head_out_all_pos: a forward run a head), on the same prompt pair

`bench_real_graph` (`glassgpt bench graph --real-size`) times one graph at a real model's
size: Qwen3-0.6B's shape with random weights (bf16 where the CPU multiplies it), a random
16k-latent transcoder a layer firing ~64 latents a token, a 32-token prompt, at most 7,500
feature nodes chosen as circuit-tracer chooses them (max_feature_nodes); and the process's
peak memory.

Library only: the CLI (`glassgpt bench graph`) prints it.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glassgpt.bench.measure import interleaved_medians
from glassgpt.config import GPTConfig, load_preset
from glassgpt.errors import ConfigError
from glassgpt.formats.transformer_lens_files import write_lens_checkpoint
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.interp.graph import attribution_graph
from glassgpt.interp.graph.prune import graph_scores, prune_graph
from glassgpt.interp.graph.select import DEFAULT_MAX_FEATURE_NODES
from glassgpt.interp.methods.attribution_patching import get_attr_patch_attn_head_out_all_pos
from glassgpt.interp.methods.patching import get_act_patch_attn_head_out_all_pos
from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.machine.devices import cpu_bf16_support
from glassgpt.model import GPT

CIRCUIT_TRACER_WORKER = Path(__file__).with_name("circuit_tracer_worker.py")
CIRCUIT_TRACER_PYTHON_ENV = "GLASSGPT_CIRCUIT_TRACER_PYTHON"
BATCH_SIZE = 64  # targets a backward pass, both contenders


@dataclass(frozen=True)
class GraphBenchSize:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    expansion: int = 16
    active: int = 32  # latents firing on a token, about
    prompt_len: int = 32
    vocab_size: int = 512
    rounds: int = 3


FULL = GraphBenchSize()
QUICK = GraphBenchSize(n_embd=64, prompt_len=16, rounds=2)


@dataclass
class GraphBenchResult:
    size: GraphBenchSize
    features: int  # active features, the graph's feature nodes
    nodes: int
    graph_s: float  # median seconds of one attribution graph
    kept_nodes: int  # after pruning at circuit-tracer's defaults
    replacement_score: float
    completeness_score: float
    heads: int
    attribution_patching_s: float  # every head, one forward and one backward
    activation_patching_s: float  # every head, a forward a head
    circuit_tracer_s: float | None = None  # circuit-tracer's attribute, same weights and prompt
    circuit_tracer_max_diff: float | None = None  # largest |its adjacency - glassgpt's|

    @property
    def patching_ratio(self) -> float:
        """How many times faster attribution patching is than activation patching."""
        return self.activation_patching_s / self.attribution_patching_s


def bench_model(size: GraphBenchSize, seed: int = 0) -> tuple[GPT, list[SAE]]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd,
                          block_size=max(64, size.prompt_len), vocab_size=size.vocab_size,
                          dropout=0.0)).eval()
    return model, [sparse_transcoder(model, layer, size) for layer in range(size.n_layer)]


def sparse_transcoder(model: GPT, layer: int, size: GraphBenchSize) -> SAE:
    """A random transcoder of layer `layer` whose b_enc lets about `size.active` latents fire:
    each latent's threshold is its pre-activation quantile on a random prompt."""
    d = size.n_embd
    config = SAEConfig(d_in=d, d_sae=d * size.expansion, architecture="transcoder", d_out=d,
                       apply_b_dec_to_input=False)
    config.metadata.hook_name = f"blocks.{layer}.ln2.hook_normalized"
    config.metadata.hook_name_out = f"blocks.{layer}.hook_mlp_out"
    sae = SAE(config)
    ids = torch.randint(size.vocab_size, (4, size.prompt_len))
    _, cache = run_with_cache(model, ids, config.metadata.hook_name)
    with torch.no_grad():
        pre = cache[config.metadata.hook_name].flatten(0, 1) @ sae.W_enc  # (N, d_sae)
        share = size.active / config.d_sae
        sae.b_enc.copy_(-torch.quantile(pre, 1 - share, dim=0))
        sae.W_dec.mul_(0.1)
    return sae


def bench_graph(size: GraphBenchSize = FULL, circuit_tracer_python: str | Path | None = None
                ) -> GraphBenchResult:
    """The figures of the module docstring; circuit-tracer's too when its python is given."""
    circuit_tracer_python = circuit_tracer_python or os.environ.get(CIRCUIT_TRACER_PYTHON_ENV)
    if circuit_tracer_python and not Path(circuit_tracer_python).is_file():
        raise ConfigError(f"circuit-tracer's python {circuit_tracer_python} does not exist")
    model, transcoders = bench_model(size)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(size.vocab_size, (1, size.prompt_len), generator=generator)
    corrupted = ids.clone()
    corrupted[0, size.prompt_len // 2] = (corrupted[0, size.prompt_len // 2] + 1) % size.vocab_size
    answer = int(ids[0, -1])
    clean_logits, clean_cache = run_with_cache(model, ids)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, answer].sum() - clean_logits[:, -1, answer].sum()

    graph = attribution_graph(model, transcoders, ids, batch_size=BATCH_SIZE)
    times = interleaved_medians({
        "graph": lambda: attribution_graph(model, transcoders, ids, batch_size=BATCH_SIZE),
        "attribution": lambda: get_attr_patch_attn_head_out_all_pos(model, corrupted,
                                                                    clean_cache, metric),
        "activation": lambda: get_act_patch_attn_head_out_all_pos(model, corrupted,
                                                                  clean_cache, metric),
    }, size.rounds)
    pruned = prune_graph(graph)
    replacement, completeness = graph_scores(graph, pruned.influence)
    result = GraphBenchResult(size, graph.n_features, graph.n_nodes, times["graph"],
                              int(pruned.node_mask[:graph.n_features].sum()), replacement,
                              completeness, size.n_layer * size.n_head, times["attribution"],
                              times["activation"])
    if circuit_tracer_python:
        seconds, theirs = circuit_tracer_graph(circuit_tracer_python, model, transcoders, ids,
                                               size.rounds)
        result.circuit_tracer_s = seconds
        result.circuit_tracer_max_diff = float((theirs - graph.adjacency_matrix).abs().max())
    return result


def circuit_tracer_graph(python: str | Path, model: GPT, transcoders: list[SAE], ids: torch.Tensor,
                         rounds: int) -> tuple[float, torch.Tensor]:
    """circuit-tracer's median seconds for the graph of `ids`, and its adjacency (N, N)."""
    with tempfile.TemporaryDirectory(prefix="glassgpt-bench-graph-") as folder:
        folder = Path(folder)
        write_lens_checkpoint(model, folder / "lens")
        (folder / "transcoders").mkdir()
        for layer, sae in enumerate(transcoders):  # circuit-tracer's layout: W_enc (d_sae, d)
            save_file({"W_enc": sae.W_enc.detach().T.contiguous(),
                       "b_enc": sae.b_enc.detach().contiguous(),
                       "W_dec": sae.W_dec.detach().contiguous(),
                       "b_dec": sae.b_dec.detach().contiguous()},
                      folder / "transcoders" / f"layer_{layer}.safetensors")
        (folder / "prompt.json").write_text(json.dumps({"ids": ids[0].tolist()}))
        done = subprocess.run([str(python), str(CIRCUIT_TRACER_WORKER), str(folder),
                               str(rounds), str(BATCH_SIZE)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"circuit-tracer failed: {done.stderr.strip()[-2000:]}")
        seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
        return statistics.median(seconds), load_file(folder / "adjacency.safetensors")[
            "adjacency_matrix"]


# --- the real size: a Qwen3-0.6B-shaped model, circuit-tracer's max_feature_nodes ---------------

CALIBRATION_PROMPTS = 8  # random prompts whose pre-activations set each encoder's biases


@dataclass(frozen=True)
class RealGraphSize:
    """A model of Qwen3-0.6B's shape (random weights) and a transcoder of d_sae latents for
    each MLP, about `active` of them firing on a token, a prompt of prompt_len random ids,
    attributed with at most max_feature_nodes feature nodes, batch_size rows a backward pass."""

    n_layer: int = 28
    n_embd: int = 1024
    n_head: int = 16
    n_kv_head: int = 8
    head_dim: int = 128
    mlp_hidden: int = 3072
    vocab_size: int = 151_936
    d_sae: int = 16_384
    active: int = 64
    prompt_len: int = 32
    max_feature_nodes: int = DEFAULT_MAX_FEATURE_NODES  # circuit-tracer's CLI's, as graph's
    batch_size: int = 256


REAL = RealGraphSize()


@dataclass
class RealGraphResult:
    size: RealGraphSize
    dtype: str  # of the weights: bfloat16 where the CPU multiplies it, else float32
    build_s: float  # the model, its transcoders and their calibration
    graph_s: float  # one attribution graph (one run: minutes)
    peak_rss_gib: float  # this process's peak resident memory, everything included
    active_features: int
    features_per_token: float  # active features a position (positions 1.., as the graph)
    feature_nodes: int
    nodes: int
    kept_nodes: int  # features after pruning at circuit-tracer's defaults
    replacement_score: float
    completeness_score: float


def bench_real_graph(size: RealGraphSize = REAL, seed: int = 0) -> RealGraphResult:
    """The attribution graph of a real model's size on this machine: time and peak memory."""
    dtype = torch.bfloat16 if cpu_bf16_support() else torch.float32
    started = time.perf_counter()
    model, transcoders = real_model(size, dtype, seed)
    build_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(size.vocab_size, (1, size.prompt_len), generator=generator)
    started = time.perf_counter()
    graph = attribution_graph(model, transcoders, ids, batch_size=size.batch_size,
                              max_feature_nodes=size.max_feature_nodes)
    graph_s = time.perf_counter() - started
    pruned = prune_graph(graph)
    replacement, completeness = graph_scores(graph, pruned.influence)
    return RealGraphResult(
        size, str(dtype).removeprefix("torch."), build_s, graph_s, peak_rss_gib(),
        graph.n_active, graph.n_active / (size.n_layer * (size.prompt_len - 1)),
        graph.n_features, graph.n_nodes, int(pruned.node_mask[:graph.n_features].sum()),
        replacement, completeness)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, GiB (ru_maxrss: KiB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def real_model(size: RealGraphSize, dtype: torch.dtype, seed: int) -> tuple[GPT, list[SAE]]:
    """Qwen3-0.6B's architecture (its preset) at `size`'s shape, random weights in `dtype`,
    and its calibrated transcoders."""
    torch.manual_seed(seed)
    shape = {name: getattr(size, name) for name in ("n_layer", "n_embd", "n_head", "n_kv_head",
                                                    "head_dim", "mlp_hidden", "vocab_size")}
    config = GPTConfig(**{**load_preset("qwen3-0.6b")["model"], **shape,
                          "block_size": max(64, size.prompt_len)})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in dtype: a float32 copy of 0.6B weights is 2.4 GB
    try:
        model = GPT(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model, calibrated_transcoders(model, size, dtype)


def calibrated_transcoders(model: GPT, size: RealGraphSize, dtype: torch.dtype) -> list[SAE]:
    """A random transcoder a layer, its encoder biases set so that about size.active latents
    fire on a token: one threshold for the layer's latents, the (active x tokens)-th largest
    of their pre-activations on random prompts. (A threshold a latent, from its own mean and
    spread over those few hundred tokens, fits them and lets 2-4x as many fire on others.)"""
    hooks = [f"blocks.{layer}.ln2.hook_normalized" for layer in range(size.n_layer)]
    ids = torch.randint(size.vocab_size, (CALIBRATION_PROMPTS, size.prompt_len))
    _, cache = run_with_cache(model, ids, hooks)
    transcoders = []
    for layer, hook in enumerate(hooks):
        config = SAEConfig(d_in=size.n_embd, d_sae=size.d_sae, architecture="transcoder",
                           d_out=size.n_embd, apply_b_dec_to_input=False,
                           dtype=str(dtype).removeprefix("torch."))
        config.metadata.hook_name = hook
        config.metadata.hook_name_out = f"blocks.{layer}.hook_mlp_out"
        sae = SAE(config)
        with torch.no_grad():
            reads = cache[hook][:, 1:].flatten(0, 1).float()  # (N, C), past the first token
            pre = (reads @ sae.W_enc.float()).flatten()  # (N * d_sae,)
            threshold = pre.topk(min(size.active * len(reads), len(pre))).values[-1]
            sae.b_enc.fill_(-float(threshold))
            sae.W_dec.mul_(0.1)
        transcoders.append(sae)
    return transcoders
