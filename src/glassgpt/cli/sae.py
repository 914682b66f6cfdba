"""`glassgpt sae train` and `glassgpt sae eval`: sparse dictionaries on a run's hook points
(glassgpt.interp.sae.training, glassgpt.interp.sae.metrics)."""

from __future__ import annotations

import argparse
import json
import threading
from typing import Any

from glassgpt.cli.common import DefaultsHelpFormatter, add_checkpoint_flag, path_arg, say

INTERRUPTED_EXIT_CODE = 130
# DictionarySettings's choices and defaults, written again here because --help imports no
# torch (glassgpt.interp does); tests/test_sae_train.py holds them equal.
ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sae", help="train and evaluate sparse dictionaries (SAELens's "
                              "format) on a run's hook points")
    commands = p.add_subparsers(dest="sae_command", metavar="COMMAND")
    _register_train(commands)
    _register_eval(commands)
    p.set_defaults(handler=lambda args: p.error("give a command: train or eval"))


def _register_train(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", formatter_class=DefaultsHelpFormatter,
                            help="train a sparse autoencoder or transcoder on a hook point",
                            description="Train a dictionary on activations of RUN_DIR's model "
                            "at --hook, streamed from the run's data or a text file; saved in "
                            "SAELens's format, with its trainer state for --resume.")
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR")
    p.add_argument("--hook", required=True, help="hook point, e.g. blocks.0.hook_resid_post")
    p.add_argument("--out", type=path_arg, required=True, help="directory to write")
    p.add_argument("--d-sae", type=int, required=True, help="number of latents")
    p.add_argument("--architecture", choices=ARCHITECTURES, default="standard")
    p.add_argument("--k", type=float, help="topk: latents per token; batchtopk: on average")
    p.add_argument("--l1", type=float, default=5.0, help="standard: L1 coefficient")
    p.add_argument("--l0", type=float, default=1.0, help="jumprelu: L0 coefficient")
    p.add_argument("--tokens", type=int, default=2_000_000, help="activations in all")
    p.add_argument("--batch-tokens", type=int, default=4096, help="activations per step")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
    p.add_argument("--transcoder", action="store_true", help="reconstruct --hook-out (default "
                   "blocks.L.hook_mlp_out) from --hook (blocks.L.ln2.hook_normalized)")
    p.add_argument("--hook-out", help="a transcoder's target point")
    p.add_argument("--eval-every", type=int, default=100, help="steps between metric lines")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between saves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=path_arg, help="prepared data directory, or a text file "
                   "(tokenised with the run's tokenizer into the cache) (default: the run's)")
    p.add_argument("--resume", action="store_true", help="continue the training in --out")
    p.add_argument("--force", action="store_true", help="replace the dictionary glassgpt "
                   "trained in --out")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_checkpoint_flag(p, "read")
    p.set_defaults(handler=run_sae_train)


def _register_eval(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eval", formatter_class=DefaultsHelpFormatter,
                            help="SAELens's metrics of a dictionary on a run's data",
                            description="L0, MSE, explained variance, CE loss recovered, dead "
                            "and dense latents and the density histogram of SAE on windows of "
                            "RUN's validation data.")
    p.add_argument("sae", type=path_arg, metavar="SAE")
    p.add_argument("--run", type=path_arg, required=True, metavar="RUN_DIR")
    p.add_argument("--tokens", type=int, default=65_536, help="tokens to evaluate on")
    p.add_argument("--data", type=path_arg, help="prepared data directory (default: the run's)")
    p.add_argument("--split", choices=("train", "val"), default="val")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu")
    add_checkpoint_flag(p, "read")
    p.set_defaults(handler=run_sae_eval)


def run_sae_train(args: argparse.Namespace) -> int:
    from glassgpt.interp.sae.training import DictionarySettings, train_dictionary

    settings = DictionarySettings(
        hook=args.hook, d_sae=args.d_sae, architecture=args.architecture,
        transcoder=args.transcoder, hook_out=args.hook_out, k=_k(args),
        l1_coefficient=args.l1, l0_coefficient=args.l0, tokens=args.tokens,
        batch_tokens=args.batch_tokens, lr=args.lr, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, seed=args.seed)
    from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

    from glassgpt.cli.common import stderr_progress

    stop = threading.Event()
    with stderr_progress("[bold]sae", BarColumn(), MofNCompleteColumn(),
                         "{task.fields[stats]}", TimeRemainingColumn()) as bar:
        result = train_dictionary(args.run_dir, settings, args.out, data=args.data,
                                  checkpoint=args.checkpoint, device=args.device,
                                  resume=args.resume, force=args.force,
                                  report=_reporter(bar, settings.steps), stop=stop)
    if result.interrupted:
        say(f"interrupted at step {result.step}; saved in {result.out}; continue with: "
            f"glassgpt sae train ... --resume --out {result.out}")
        return INTERRUPTED_EXIT_CODE
    print(f"trained {settings.architecture} dictionary ({settings.d_sae} latents) at "
          f"{settings.hook} for {result.step} steps in {result.seconds:.1f}s; saved in "
          f"{result.out}" + (f"; {_metrics_line(result.metrics.summary())}"
                             if result.metrics else ""))
    return 0


def _k(args: argparse.Namespace) -> float | int | None:
    if args.k is None or args.architecture != "topk":
        return args.k
    return int(args.k) if float(args.k).is_integer() else args.k


def _reporter(bar: Any, steps: int) -> Any:
    """Progress on the bar (on a terminal), and a line on stderr per metric report."""
    task = bar.add_task("sae", total=steps, stats="")

    def report(step: int, record: dict[str, Any]) -> None:
        bar.update(task, completed=step, stats=f"mse {record['mse_loss']:.4g}  l0 "
                   f"{record['l0']:.1f}  dead {record['dead']}")
        if "eval_l0" in record:
            say(f"step {step}: " + _metrics_line(
                {k.removeprefix("eval_"): v for k, v in record.items()
                 if k.startswith("eval_")}))

    return report


def _metrics_line(m: dict[str, Any]) -> str:
    ce = "" if m.get("ce_loss_recovered") is None else \
        f", CE loss recovered {m['ce_loss_recovered']:.3f}"
    return (f"L0 {m['l0']:.2f}, explained variance {m['explained_variance']:.3f}, MSE "
            f"{m['mse']:.4g}{ce}, {m['dead']} dead, {m['dense']} dense")


def run_sae_eval(args: argparse.Namespace) -> int:
    from glassgpt.data import PreparedData, sequential_batches
    from glassgpt.errors import ConfigError
    from glassgpt.interp.sae import SAE
    from glassgpt.interp.sae.metrics import evaluate_dictionary
    from glassgpt.rundir import checkpoint as ckpt

    if args.tokens <= 0:
        raise ConfigError(f"--tokens must be positive, got {args.tokens}")
    run = ckpt.Run(args.run)
    model, _ = run.load_model(args.device, checkpoint=args.checkpoint)
    sae = SAE.load(args.sae, device=args.device)
    data_dir = args.data or run.data_dir
    if data_dir is None:
        raise ConfigError(f"{run.dir} records no data directory; pass --data")
    context = min(int(sae.cfg.metadata.context_size or 128), model.config.block_size)
    windows = max(1, args.tokens // context)
    batches = sequential_batches(PreparedData(data_dir).splits[args.split], context, 8,
                                 -(-windows // 8), args.device, model.config.vocab_size)
    metrics = evaluate_dictionary(model, sae, batches)
    counts, edges = metrics.density_histogram(bins=10)
    if args.json:
        print(json.dumps({**metrics.summary(), "log10_density_histogram":
                          {"counts": counts.tolist(), "edges": edges.tolist()}}))
        return 0
    print(_metrics_line(metrics.summary()) + f" ({metrics.tokens:,} tokens)")
    print("log10 feature density:")
    for count, low, high in zip(counts.tolist(), edges[:-1].tolist(), edges[1:].tolist(),
                                strict=True):
        print(f"  [{low:5.1f}, {high:5.1f})  {count:6d}  {'#' * min(count, 60)}")
    return 0
