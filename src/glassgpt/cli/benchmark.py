"""`glassgpt bench [train|generate|all]`: measure speed against the machine's limits and HF GPT-2.

All measuring lives in `glassgpt.bench`; this module parses flags, prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from glassgpt.cli.common import output_console, path_arg
from glassgpt.cli.ladder import add_ladder_flags, run_ladder_command
from glassgpt.config import DECODE_PRESETS, NEW_TOKENS, PROMPT_LEN, TRAIN_PRESETS
from glassgpt.errors import ConfigError
from glassgpt.storage.files import write_text_atomic
from glassgpt.storage.outputs import check_output_file

if TYPE_CHECKING:  # torch and glassgpt.bench load in the handlers: --help answers at once
    from glassgpt import bench

WORKLOADS = ("train", "generate", "all", "threads", "ladder", "startup", "sae", "graph",
             "lora")
# --quick: (training preset, decoding preset) per device, 3 rounds.
QUICK_PRESETS = {"cpu": ("cpu-small", "shakespeare-char"), "cuda": ("gpt2", "gpt2")}
QUICK_ROUNDS = 3
# `bench ladder --quick`, measured on an idle 2-core CPU (docs/time-to-loss.md says the same)
LADDER_QUICK_TIME = "~15 s"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="measure training and decoding speed",
        description="Measure the machine's fp32 matmul peak and read bandwidth, then training "
        "tokens/s and MFU, and decoding tokens/s with and without the KV cache, optionally "
        "beside Hugging Face GPT-2 of the same shape. Contenders run in interleaved rounds; "
        "warm-up is excluded and medians are reported.")
    p.add_argument("workload", nargs="?", choices=WORKLOADS, default="all")
    p.add_argument("--preset", nargs="+", metavar="NAME",
                   help=f"model shapes to measure (default: {', '.join(TRAIN_PRESETS)} "
                   f"for training, {', '.join(DECODE_PRESETS)} for decoding)")
    p.add_argument("--against", choices=["hf", "llamacpp"],
                   help="hf: also measure transformers' GPT-2; llamacpp (with generate): "
                   "glassgpt's CPU decoding beside llama.cpp's on the same weights written as "
                   "GGUF, at 1 thread and all (needs the extra llamacpp)")
    p.add_argument("--json", type=path_arg, metavar="FILE", help="also write every figure here")
    p.add_argument("--force", action="store_true",
                   help="replace the --json (and ladder's --plot) files if they exist")
    p.add_argument("--rounds", type=int, help="timed rounds per contender (default: 5; "
                   "decoding without a KV cache, tens of times slower, gets 3)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                   help=f"tokens to decode after a {PROMPT_LEN}-token prompt")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile contenders, training and decoding "
                   "(compiling takes a while)")
    p.add_argument("--dropout", default="0",
                   help="dropout of the trained models: a rate, or `preset` for each preset's "
                   "own (default 0, as nanoGPT's bench.py)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one training and one decoding step (torch.profiler)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--no-load", action="store_true",
                   help="bench threads: measure without the competing process")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where to measure (default: cpu)")
    p.add_argument("--quick", action="store_true",
                   help="one model shape per workload and fewer rounds: a few minutes "
                   f"(presets: {QUICK_PRESETS['cpu']} on a CPU, {QUICK_PRESETS['cuda']} on "
                   f"CUDA); with ladder, every rung at a toy size: {LADDER_QUICK_TIME}")
    p.add_argument("--saelens-python", type=path_arg, metavar="PYTHON",
                   help="bench sae: the python of a venv with sae-lens, to measure SAELens's "
                   "trainer beside glassgpt's (default: $GLASSGPT_SAELENS_PYTHON)")
    p.add_argument("--circuit-tracer-python", type=path_arg, metavar="PYTHON",
                   help="bench graph: the python of a venv with circuit-tracer, to time its "
                   "graph beside glassgpt's (default: $GLASSGPT_CIRCUIT_TRACER_PYTHON)")
    p.add_argument("--real-size", action="store_true",
                   help="bench graph: one attribution graph of a Qwen3-0.6B-shaped model (28 "
                   "layers, random weights) over 28 random 16k-latent transcoders, 32 tokens, "
                   "at most 7,500 feature nodes: its time and peak memory (minutes)")
    add_ladder_flags(p)
    p.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if args.workload == "startup":  # fresh processes only: this one needs no torch
        return _bench_startup(args)
    import torch

    from glassgpt import bench

    if args.threads is not None:
        most = 4 * (os.cpu_count() or 1)  # more threads than that only thrash (or crash)
        if not 0 < args.threads <= most:
            raise ConfigError(f"--threads must be between 1 and {most} on this machine, "
                              f"got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.rounds is not None and args.rounds <= 0:
        raise ConfigError(f"--rounds must be positive, got {args.rounds}")
    if args.new_tokens <= 0:
        raise ConfigError(f"--new-tokens must be positive, got {args.new_tokens}")
    if args.json is not None:
        check_output_file(args.json, args.force, ConfigError)  # before minutes of measuring
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but CUDA is not available here")
    if args.real_size and args.workload != "graph":
        raise ConfigError(f"--real-size sizes `bench graph`, not `bench {args.workload}`")
    if args.workload == "threads":
        return _bench_threads(args)
    if args.workload == "sae":
        return _bench_sae(args)
    if args.workload == "graph":
        return _bench_graph(args)
    if args.workload == "lora":
        return _bench_lora(args)
    if args.workload == "ladder":  # time to loss, one speedrun change at a time
        return run_ladder_command(args)
    if args.against == "llamacpp":
        return _bench_llamacpp(args)
    train_presets, decode_presets = _presets(args)
    err = Console(stderr=True)
    with err.status("benchmarking") as status:
        report = bench.run_benchmarks(
            args.workload, train_presets, decode_presets, against_hf=args.against == "hf",
            rounds=args.rounds or (QUICK_ROUNDS if args.quick else None),
            new_tokens=args.new_tokens, compiled=not args.no_compile, profile=args.profile,
            train_dropout=_dropout(args.dropout), device=args.device, progress=status.update)
    print_report(report, output_console())
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


def _bench_threads(args: argparse.Namespace) -> int:
    """`bench threads`: training tokens/s per thread setting beside a process spinning on one
    core (the busy machine `--threads auto` is for)."""
    from glassgpt import bench

    preset = (args.preset or ["cpu-small"])[0]
    with Console(stderr=True).status(f"training {preset} under each thread setting"):
        rows = bench.bench_threads(preset, rounds=args.rounds or 3, load=not args.no_load)
    best_fixed = max(r.tokens_per_s for r in rows if r.setting not in ("auto",))
    table = Table(title=f"Training {preset} with a second process spinning on one core"
                  if not args.no_load else f"Training {preset}, no competing load",
                  caption=f"{bench.machine_info()['cpu']}, {os.cpu_count()} cores")
    for column in ("setting", "threads used", "tokens/s", "ms/step", "of best fixed"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for r in rows:
        table.add_row(r.setting, str(r.threads_used), f"{r.tokens_per_s:,.0f}",
                      f"{r.step_seconds * 1e3:.1f}", f"{r.tokens_per_s / best_fixed:.0%}")
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps([dataclasses.asdict(r) for r in rows],
                                                indent=2) + "\n")
    return 0


def _bench_sae(args: argparse.Namespace) -> int:
    """`bench sae`: a 16x TopK dictionary on a 128-wide model's activations, glassgpt's trainer
    beside SAELens's on the same cached activations, and glassgpt streaming from the model."""
    from glassgpt.bench.report import machine_info
    from glassgpt.bench.sae import FULL, QUICK, bench_sae

    size = QUICK if args.quick else FULL
    with Console(stderr=True).status(f"training {size.d_sae}-latent dictionaries"):
        rows = bench_sae(size, args.saelens_python)
    saelens = any(r.contender.startswith("SAELens") for r in rows)
    table = Table(title=f"Training a TopK dictionary (d_in {size.d_model}, d_sae {size.d_sae}, "
                  f"k {size.k}, batch {size.batch_tokens})",
                  caption=f"{machine_info()['cpu']}, {os.cpu_count()} cores"
                  + ("" if saelens else "; SAELens not measured (no --saelens-python)"))
    for column in ("contender", "activations", "activations/s", "peak MiB", "explained var"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for r in rows:
        ev = "" if r.explained_variance is None else f"{r.explained_variance:.3f}"
        table.add_row(r.contender, f"{r.tokens:,}", f"{r.activations_per_s:,.0f}",
                      f"{r.peak_rss_mib:,.0f}", ev)
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps([dataclasses.asdict(r) for r in rows],
                                                indent=2) + "\n")
    return 0


def _bench_graph(args: argparse.Namespace) -> int:
    """`bench graph`: an attribution graph of a prompt over a model's transcoders, and
    attribution patching of every head beside activation patching of every head."""
    from glassgpt.bench.graph import FULL, QUICK, bench_graph
    from glassgpt.bench.report import machine_info

    if args.real_size:
        return _bench_real_graph(args)
    size = QUICK if args.quick else FULL
    if args.rounds is not None:
        size = dataclasses.replace(size, rounds=args.rounds)
    with Console(stderr=True).status("building attribution graphs"):
        r = bench_graph(size, args.circuit_tracer_python)
    table = Table(title=f"Circuits with gradients ({size.n_layer} layers, width {size.n_embd}, "
                  f"{size.expansion}x transcoders, {size.prompt_len}-token prompt)",
                  caption=f"{machine_info()['cpu']}, {os.cpu_count()} cores, median of "
                  f"{size.rounds} rounds" + ("" if r.circuit_tracer_s is not None else
                                             "; circuit-tracer not measured "
                                             "(no --circuit-tracer-python)"))
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in (
            ("active features (graph nodes)", f"{r.features:,} ({r.nodes:,})"),
            ("attribution graph, s", f"{r.graph_s:.2f}"),
            *([("circuit-tracer's graph, same weights, s", f"{r.circuit_tracer_s:.2f}"),
               ("circuit-tracer's time / glassgpt's", f"{r.circuit_tracer_s / r.graph_s:.1f}x"),
               ("largest |adjacency difference|", f"{r.circuit_tracer_max_diff:.1e}")]
              if r.circuit_tracer_s is not None else []),
            ("kept after pruning (0.8 / 0.98)", f"{r.kept_nodes:,}"),
            ("replacement / completeness score",
             f"{r.replacement_score:.3f} / {r.completeness_score:.3f}"),
            (f"attribution patching, {r.heads} heads, ms", f"{r.attribution_patching_s * 1e3:.1f}"),
            (f"activation patching, {r.heads} heads, ms", f"{r.activation_patching_s * 1e3:.1f}"),
            ("activation patching's time / attribution patching's",
             f"{r.patching_ratio:.1f}x")):
        table.add_row(name, value)
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps({**dataclasses.asdict(r),
                                                 "patching_ratio": r.patching_ratio},
                                                indent=2) + "\n")
    return 0


def _bench_real_graph(args: argparse.Namespace) -> int:
    """`bench graph --real-size`: one attribution graph at a real model's size, capped at
    circuit-tracer's max_feature_nodes: its time and this process's peak memory."""
    import torch

    from glassgpt.bench.graph import REAL, bench_real_graph
    from glassgpt.bench.report import machine_info

    size, threads = REAL, torch.get_num_threads()
    with Console(stderr=True).status("building a real-size attribution graph (minutes)"):
        r = bench_real_graph(size)
    table = Table(title=f"A real-size attribution graph ({size.n_layer} layers, width "
                  f"{size.n_embd}, {size.n_head} heads / {size.n_kv_head} KV, vocabulary "
                  f"{size.vocab_size:,}; {size.d_sae:,}-latent transcoders; "
                  f"{size.prompt_len}-token prompt)",
                  caption=f"{machine_info()['cpu']}, {os.cpu_count()} cores, "
                  f"{threads} thread{'s' if threads != 1 else ''}, one run, weights in {r.dtype}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in (
            ("active features (a token)", f"{r.active_features:,} ({r.features_per_token:.0f})"),
            ("feature nodes (at most), all nodes",
             f"{r.feature_nodes:,} ({size.max_feature_nodes:,}), {r.nodes:,}"),
            ("model and transcoders built, s", f"{r.build_s:.1f}"),
            ("attribution graph, s", f"{r.graph_s:.1f}"),
            ("peak resident memory, GiB", f"{r.peak_rss_gib:.2f}"),
            ("kept after pruning (0.8 / 0.98)", f"{r.kept_nodes:,}"),
            ("replacement / completeness score",
             f"{r.replacement_score:.3f} / {r.completeness_score:.3f}")):
        table.add_row(name, value)
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(dataclasses.asdict(r), indent=2) + "\n")
    return 0


def _bench_llamacpp(args: argparse.Namespace) -> int:
    """`bench generate --against llamacpp`: one table of tokens/s, bandwidth fraction and
    prefill rate per decoder, precision and thread count (glassgpt.bench.llamacpp)."""
    from glassgpt.bench.llamacpp import PRESETS, bench_against_llamacpp
    from glassgpt.bench.report import machine_info

    if args.workload != "generate":
        raise ConfigError("--against llamacpp measures decoding: `glassgpt bench generate "
                          "--against llamacpp`")
    presets = tuple(args.preset or (PRESETS[:1] if args.quick else PRESETS))
    tokens = 32 if args.quick and args.new_tokens == NEW_TOKENS else args.new_tokens
    with Console(stderr=True).status("decoding beside llama.cpp") as status:
        report = bench_against_llamacpp(presets, rounds=args.rounds or (2 if args.quick else 3),
                                        new_tokens=tokens, compiled=not args.no_compile,
                                        progress=status.update)
    agree = "; ".join([f"{p}: glassgpt fp32 and llama.cpp F32 greedy tokens equal for {n} of "
                       f"{of}" for p, (n, of) in report.same_tokens.items()]
                      + [f"{p}: {n} of {of}" for p, (n, of) in report.same_blocks.items()])
    table = Table(title=f"Decoding beside llama.cpp (batch 1, greedy, {tokens} new tokens, "
                  f"random weights)", caption=f"{machine_info()['cpu']}, {os.cpu_count()} "
                  f"cores; median of rounds (slowest-fastest); bandwidth: of the best read "
                  f"probed in the same rounds; {agree}")
    for column in ("preset", "threads", "decoder", "precision", "tokens/s", "range",
                   "of bandwidth", "prefill tok/s"):
        table.add_column(column, justify="right" if column in ("threads", "tokens/s",
                                                               "of bandwidth",
                                                               "prefill tok/s") else "left")
    for r in report.rows:
        table.add_row(r.preset, str(r.threads), r.decoder, r.precision,
                      f"{r.tokens_per_s:,.1f}", f"{r.slowest:,.1f}-{r.fastest:,.1f}",
                      f"{r.bandwidth_fraction:.0%}", f"{r.prefill_tokens_per_s:,.0f}")
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(
            {"rows": [dataclasses.asdict(r) for r in report.rows],
             "same_tokens": report.same_tokens, "same_blocks": report.same_blocks,
             "read_bandwidth": {f"{p} {t}": b for (p, t), b in report.read_bandwidth.items()}},
            indent=2) + "\n")
    return 0


def _bench_lora(args: argparse.Namespace) -> int:
    """`bench lora`: LoRA steps on a random-weight Qwen3-0.6B shape, and peak memory against
    its bf16 weights, without and with activation checkpointing."""
    from glassgpt.bench.lora import FULL, QUICK, WAYS, bench_lora
    from glassgpt.bench.report import machine_info

    size = QUICK if args.quick else FULL
    rows = []
    with Console(stderr=True).status(f"fine-tuning {size.preset}'s shape with LoRA"):
        for checkpointed in WAYS:
            rows.append(bench_lora(dataclasses.replace(size, checkpointed=checkpointed)))
    layers = f"{size.n_layer} layers of " if size.n_layer else ""
    table = Table(title=f"LoRA r={size.rank} on every projection of {layers}{size.preset} "
                  f"(random weights), {size.batch_size} x {size.seq_len} tokens a step",
                  caption=f"{machine_info()['cpu']}, {os.cpu_count()} cores; peak: the "
                  "process's high-water resident memory")
    for column in ("activations", "base", "s/step", "peak MiB", "bf16 weights MiB",
                   "peak / weights"):
        table.add_column(column, justify="left" if column == "activations" else "right")
    for r in rows:
        table.add_row("recomputed" if r.size.checkpointed else "kept", r.dtype,
                      f"{r.seconds_per_step:.2f}", f"{r.peak_rss_mib:,.0f}",
                      f"{r.base_weight_mib:,.0f}", f"{r.peak_over_bf16_weights:.2f}x")
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps([{**dataclasses.asdict(r), "peak_over_bf16_"
                                                  "weights": r.peak_over_bf16_weights}
                                                 for r in rows], indent=2) + "\n")
    return 0


def _bench_startup(args: argparse.Namespace) -> int:
    """`bench startup`: seconds before `glassgpt --help`, `train --help` and a flag typo
    answer, each a fresh process, against `python -c "import torch"` on this machine."""
    from glassgpt.bench.startup import measure_startup

    if args.rounds is not None and args.rounds <= 0:
        raise ConfigError(f"--rounds must be positive, got {args.rounds}")
    if args.json is not None:
        check_output_file(args.json, args.force, ConfigError)
    with Console(stderr=True).status("starting fresh processes"):
        rows = measure_startup(rounds=args.rounds or 5)
    table = Table(title="Start-up: a fresh process until it answers (median of "
                  f"{args.rounds or 5} rounds)", caption=f"{os.cpu_count()} cores")
    for column in ("command", "median s", "best s", "of import torch"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for r in rows:
        table.add_row(r.command, f"{r.median_s:.3f}", f"{r.best_s:.3f}",
                      f"{r.vs_import_torch:.0%}")
    output_console().print(table)
    if args.json is not None:
        write_text_atomic(args.json, json.dumps([dataclasses.asdict(r) for r in rows],
                                                indent=2) + "\n")
    return 0


def _presets(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(training presets, decoding presets): --preset, else --quick's, else the defaults."""
    if args.preset:
        return args.preset, args.preset
    if args.quick:
        train, decode = QUICK_PRESETS[args.device]
        return [train], [decode]
    return list(TRAIN_PRESETS), list(DECODE_PRESETS)


def _dropout(value: str) -> float | None:
    if value == "preset":
        return None
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not 0.0 <= rate < 1.0:  # NaN too
        raise ConfigError(f"--dropout must be a rate in [0, 1) or `preset`, got {value!r}")
    return rate


def print_report(report: bench.BenchReport, console: Console) -> None:
    from glassgpt import bench

    m, limits = report.machine, report.limits
    console.print(f"{m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; "
                  f"torch {m['torch']}" + (f", transformers {m['transformers']}"
                                            if "transformers" in m else ""))
    if "gpu" in m:
        peak = m.get("datasheet_bf16_flops")
        console.print(f"measuring on {m['gpu']}" + (f" (datasheet dense bf16 peak "
                                                      f"{peak / 1e12:,.0f} TFLOP/s)" if peak
                                                      else ""))
    if m.get("load_before") is not None:
        console.print(f"load average {m['load_before']:.2f} before the run, "
                      f"{m['load_after']:.2f} after")
    console.print(f"at the start: fp32 matmul peak {_flops(limits.matmul_flops)}, "
                  f"read bandwidth {limits.read_bandwidth / 1e9:.1f} GB/s (each table's are "
                  f"probed in its own rounds)")
    if report.train:
        console.print(_train_table(report.train, m.get("datasheet_bf16_flops")))
    if report.decode:
        console.print(_decode_table(report.decode))
    if report.precision:
        console.print(_precision_table(report.precision))
    if report.profile:
        console.print(_profile_table(report.profile))
    ratios = bench.speedups(report)
    if ratios:
        console.print(_speedup_table(ratios))


def _train_table(rows: list[bench.TrainSpeed], datasheet: float | None = None) -> Table:
    peaks = {(r.preset, r.dtype): r.matmul_flops for r in rows}
    table = Table(title="Training (one optimizer step per round; bfloat16 = autocast)",
                  caption="MFU against the matmul peak of its dtype, probed in the same rounds: "
                  + ", ".join(f"{preset} {dtype} {_flops(peak)}"
                              for (preset, dtype), peak in peaks.items())
                  + (f"; datasheet: the GPU's dense bf16 peak, {_flops(datasheet)}"
                     if datasheet else ""))
    columns = ["preset", "contender", "dtype", "batch x T", "dropout", "ms/step", "tokens/s",
               "MFU"] + (["MFU (datasheet)"] if datasheet else [])
    for column in columns:
        table.add_column(column, justify="left" if column in ("preset", "contender") else "right")
    for r in rows:
        cells = [r.preset, r.contender, r.dtype, f"{r.batch_size} x {r.seq_len}",
                 f"{r.dropout:g}", f"{r.step_seconds * 1e3:.1f}", f"{r.tokens_per_s:,.0f}",
                 f"{r.mfu:.0%}"]
        if datasheet:
            cells.append(f"{r.tokens_per_s * r.flops_per_token / datasheet:.0%}")
        table.add_row(*cells)
    return table


def _flops(value: float) -> str:
    return f"{value / 1e12:,.0f} TFLOP/s" if value >= 1e13 else f"{value / 1e9:,.0f} GFLOP/s"


def _decode_table(rows: list[bench.DecodeSpeed]) -> Table:
    bandwidths = {r.preset: r.read_bandwidth for r in rows}
    table = Table(title=f"Decoding (batch 1, {PROMPT_LEN}-token prompt, greedy)",
                  caption="bandwidth limit from the read bandwidth probed in the same rounds: "
                  + ", ".join(f"{preset} {bw / 1e9:.1f} GB/s" for preset, bw in bandwidths.items()))
    for column in ("preset", "contender", "KV cache", "dtype", "tokens/s", "MB/token",
                   "of BW limit"):
        table.add_column(column, justify="left" if column in ("preset", "contender") else "right")
    for r in rows:
        table.add_row(r.preset, r.contender, "yes" if r.cache else "no", r.dtype,
                      f"{r.tokens_per_s:,.1f}", f"{r.bytes_per_token / 1e6:.1f}",
                      f"{r.bandwidth_fraction:.0%}")
    return table


def _precision_table(rows: list[bench.PrecisionCost]) -> Table:
    table = Table(title="What lower precision costs (teacher-forced on the fp32 greedy output)",
                  caption="bfloat16: every weight and activation; int8: every product's "
                  "weight int8 with a scale per row, activations float32")
    for column in ("preset", "dtype", "top-1 agreement", "mean KL (nats)", "max |logit error|"):
        table.add_column(column, justify="left" if column in ("preset", "dtype") else "right")
    for r in rows:
        table.add_row(r.preset, r.dtype, f"{r.top1_agreement:.1%}", f"{r.mean_kl:.2e}",
                      f"{r.max_logit_error:.3g}")
    return table


def _profile_table(rows: list[bench.OpShare]) -> Table:
    table = Table(title="Where the time goes (self CPU time of one profiled step)")
    for column in ("step", "preset", "op", "share", "calls"):
        table.add_column(column, justify="right" if column in ("share", "calls") else "left",
                         overflow="fold")
    for r in rows:
        table.add_row(r.workload, r.preset, r.op, f"{r.share:.1%}", str(r.calls))
    return table


def _speedup_table(rows: list[bench.Speedup]) -> Table:
    table = Table(title="Speed-ups measured in this run")
    for column in ("workload", "preset", "glassgpt", "against", "ratio"):
        table.add_column(column, justify="right" if column == "ratio" else "left")
    for r in rows:
        table.add_row(r.workload, r.preset, r.contender, r.reference, f"{r.ratio:.2f}x")
    return table

