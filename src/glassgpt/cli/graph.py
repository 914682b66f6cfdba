"""`glassgpt graph RUN --transcoders DIR --prompt TEXT`: the attribution graph of a prompt
through a run's model with each MLP replaced by its transcoder (glassgpt.interp.graph)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from glassgpt.cli.common import DefaultsHelpFormatter, add_checkpoint_flag, path_arg, say
from glassgpt.errors import ConfigError

# A graph of more rows than this (one backward pass of attribution_graph's default batch) says
# what it attributes before it starts: past a few seconds, a command is not silent.
SAY_ROWS_ABOVE = 64


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "graph", formatter_class=DefaultsHelpFormatter,
        help="draw a prompt's attribution graph over the run's transcoders",
        description="The circuit from the prompt's tokens through transcoder features to its "
                    "most likely next tokens (circuit-tracer's method): each MLP replaced by "
                    "its transcoder plus an error node, attention patterns and norm scales "
                    "frozen, edges the direct effects between nodes, pruned by influence on "
                    "the logits. Prints the scores and the most influential features.")
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR")
    p.add_argument("--transcoders", type=path_arg, nargs="+", default=[], metavar="DIR",
                   help="transcoders, one a layer (glassgpt sae train --transcoder): their "
                        "directories, or one directory holding them, or circuit-tracer's "
                        "directory (config.yaml beside its layer files) (an attention-only "
                        "model needs none)")
    p.add_argument("--prompt", required=True, help="the text whose next token is explained")
    p.add_argument("--node-threshold", type=float, default=0.8,
                   help="keep the features that carry this share of the influence")
    p.add_argument("--edge-threshold", type=float, default=0.98,
                   help="keep the edges that carry this share of the influence")
    p.add_argument("--max-logits", type=int, default=10, help="most logit nodes")
    p.add_argument("--logit-prob", type=float, default=0.95,
                   help="logit nodes: the likeliest tokens until their probability reaches this")
    p.add_argument("--max-feature-nodes", type=int, default=None, metavar="N",
                   help="at most N active features become nodes, chosen greedily by their "
                        "influence on the logits (circuit-tracer's max_feature_nodes; default: "
                        "its CLI's 7500, glassgpt.interp.graph.select.DEFAULT_MAX_FEATURE_NODES):"
                        " a real model's graph then fits in memory")
    p.add_argument("--top", type=int, default=10, help="features to list")
    p.add_argument("--out", type=path_arg, help="save the whole graph (.safetensors)")
    p.add_argument("--json", type=path_arg, help="write the pruned graph's nodes and edges")
    p.add_argument("--force", action="store_true", help="replace the --out and --json files "
                   "an earlier glassgpt graph wrote (no other file)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--any-run", action="store_true", help="use transcoders glassgpt trained on "
                   "another run's model (neither this run's directory nor its weights)")
    add_checkpoint_flag(p, "read")
    p.set_defaults(handler=run_graph)


def check_flags(args: argparse.Namespace) -> None:
    """The numbers and the output files, refused in one line before any work: a share outside
    (0, 1], a count below 1, one file named for both outputs, a file already there."""
    from glassgpt.storage.outputs import check_output_file

    for name in ("node_threshold", "edge_threshold", "logit_prob"):
        if not 0 < getattr(args, name) <= 1:
            raise ConfigError(f"--{name.replace('_', '-')} is a share in (0, 1], got "
                              f"{getattr(args, name)}")
    for name in ("max_logits", "top", "max_feature_nodes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got "
                              f"{getattr(args, name)}")
    if args.out is not None and args.json is not None and same_file(args.out, args.json):
        raise ConfigError(f"--out and --json both name {args.json}: the graph and its JSON "
                          f"need a file each")
    for output, flag in ((args.out, "--out"), (args.json, "--json")):
        if output is not None:
            check_output_file(output, args.force, ConfigError)
            check_replacing(output, flag)


def check_replacing(output: Path, flag: str) -> None:
    """--force replaces only a file `glassgpt graph` wrote, checked by its content: a graph's
    safetensors (--out) or its JSON (--json); a user's file of the same name stays."""
    from glassgpt.interp.graph import AttributionGraph
    from glassgpt.interp.graph.export import is_pruned_json

    if not output.exists():
        return
    ours = AttributionGraph.saved_at(output) if flag == "--out" else is_pruned_json(output)
    if not ours:
        what = "an attribution graph" if flag == "--out" else "a graph's JSON"
        raise ConfigError(f"{flag} {output} is not {what} glassgpt graph wrote; --force "
                          f"replaces only such a file: give another name")


def same_file(first: Path, second: Path) -> bool:
    """Whether two paths name one file: the same path once resolved (links followed), or
    two names of one existing file."""
    if first.resolve() == second.resolve():
        return True
    try:
        return first.samefile(second)
    except OSError:  # one of them does not exist yet
        return False


def run_graph(args: argparse.Namespace) -> int:
    from glassgpt.cli.common import step_bar
    from glassgpt.decoding.generate import encode_prompt
    from glassgpt.interp.graph import attribution_graph
    from glassgpt.interp.graph.export import few_features_line, pruned_json, top_features
    from glassgpt.interp.graph.prune import graph_scores, prune_graph
    from glassgpt.interp.graph.select import DEFAULT_MAX_FEATURE_NODES
    from glassgpt.rundir.checkpoint import load_model
    from glassgpt.storage import files

    check_flags(args)  # before the model is read and the graph built
    model, tokenizer = load_model(args.run_dir, args.device, args.checkpoint)
    transcoders = _transcoders(args, model)
    ids, given = encode_prompt(tokenizer, args.prompt, model.config.block_size, args.device)
    if given > ids.shape[1]:
        say(f"the prompt has {given} tokens; the graph reads its last {ids.shape[1]}")
    with step_bar("graph", "rows") as bar:
        graph = attribution_graph(model, transcoders, ids, max_n_logits=args.max_logits,
                                  desired_logit_prob=args.logit_prob,
                                  max_feature_nodes=args.max_feature_nodes
                                  or DEFAULT_MAX_FEATURE_NODES,
                                  progress=_drawn(bar))
    pruned = prune_graph(graph, args.node_threshold, args.edge_threshold)
    replacement, completeness = graph_scores(graph, pruned.influence)

    def decode(token: int) -> str:
        return tokenizer.decode([token])

    kept = int(pruned.node_mask[:graph.n_features].sum())
    print(f"{graph.n_pos} tokens, {feature_count(graph)}, {graph.n_logits} logits; "
          f"kept {kept} features and {int(pruned.edge_mask.sum())} edges (node threshold "
          f"{args.node_threshold}, edge threshold {args.edge_threshold})")
    print(f"replacement score {replacement:.3f}, completeness score {completeness:.3f}")
    why = few_features_line(graph, pruned)
    if why is not None:
        print(why)
    print("logits: " + ", ".join(f"{decode(int(t))!r} {float(p):.3f}" for t, p in
                                 zip(graph.logit_tokens, graph.logit_probabilities,
                                     strict=True)))
    for node in top_features(graph, pruned, args.top):
        print(f"  layer {node['layer']} feature {node['feature']:>5} at "
              f"{decode(int(graph.input_ids[node['position']]))!r} (position "
              f"{node['position']}): activation {node['activation']:.3f}, influence "
              f"{node['influence']:.3f}")
    if args.out is not None:
        print(f"saved {graph.save(args.out)}")
    if args.json is not None:
        data = pruned_json(graph, pruned, (args.node_threshold, args.edge_threshold), decode)
        args.json.parent.mkdir(parents=True, exist_ok=True)  # as --out's folder is made
        files.write_text_atomic(args.json, json.dumps(data))
        print(f"wrote {args.json}")
    return 0


def feature_count(graph: Any) -> str:
    """"270 active features", or with fewer nodes than active features "55,012 active
    features (7,500 of them nodes: --max-feature-nodes)"."""
    active = f"{graph.n_active:,} active features"
    if graph.n_features == graph.n_active:
        return active
    return f"{active} ({graph.n_features:,} of them nodes: --max-feature-nodes)"


def _drawn(bar: Any) -> Any:
    """attribution_graph's progress on the bar, after a line saying what a graph of more than
    SAY_ROWS_ABOVE rows attributes."""
    def progress(graph: Any, done: int, total: int) -> None:
        if done == 0:
            if total > SAY_ROWS_ABOVE:
                say(start_line(graph, total))
            bar.begin(total)
        bar.advance(done)
    return progress


def start_line(graph: Any, rows: int) -> str:
    """"attributing 6,537 rows of the adjacency (6,534 active features at 12 tokens and 3
    logits)": the targets whose gradients the backward passes compute."""
    logits = f"{graph.n_logits} logit{'s' if graph.n_logits != 1 else ''}"
    features = f"{graph.n_features:,} active features"
    if rows < graph.n_features + graph.n_logits:  # --max-feature-nodes: the rows of the chosen
        features = f"{rows - graph.n_logits:,} of {features}, the most influential"
    return (f"attributing {rows:,} rows of the adjacency ({features} at {graph.n_pos} tokens "
            f"and {logits})")


def _transcoders(args: argparse.Namespace, model: Any) -> list[Any]:
    """--transcoders, each refused in one line unless it replaces one of the model's MLPs
    (as `glassgpt view --transcoders` refuses it) and, without --any-run, was trained on this
    run (glassgpt.interp.sae.provenance)."""
    from glassgpt.errors import GlassGPTError, InputError
    from glassgpt.interp.graph import load_transcoders
    from glassgpt.interp.graph.replacement import by_layer
    from glassgpt.interp.sae.circuit_tracer import is_circuit_tracer_dir, load_circuit_tracer
    from glassgpt.interp.sae.provenance import check_trained_on

    try:
        if len(args.transcoders) == 1 and is_circuit_tracer_dir(args.transcoders[0]):
            # circuit-tracer's directory: a transcoder set, or a CLT
            transcoders = load_circuit_tracer(args.transcoders[0], model, device=args.device)
        else:
            transcoders = load_transcoders(args.transcoders, device=args.device)
        by_layer(model, transcoders)
        if not args.any_run:
            check_trained_on([(f"the transcoder of {sae.cfg.hook_name_out}", sae)
                              for sae in transcoders],
                             args.run_dir, args.checkpoint, "train transcoders on this run, or "
                             "pass --any-run to use these")
    except GlassGPTError as error:
        raise InputError(f"--transcoders: {error}") from None
    return transcoders
