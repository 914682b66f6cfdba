"""`glassgpt convert`: Hugging Face weights into a run directory, and back.

    glassgpt convert --from-hf NAME_OR_DIR --out RUN_DIR   # hub name (e.g. gpt2) or local dir
    glassgpt convert RUN_DIR --to-hf OUT_DIR               # a save_pretrained directory
    glassgpt convert RUN_DIR --to-lens OUT_DIR             # TransformerLens's checkpoint format
    glassgpt convert RUN_DIR --to-lens OUT_DIR --circuit-tracer  # ... that circuit-tracer loads
    glassgpt convert RUN_DIR --to-gguf OUT.gguf [--dtype q8_0]   # one file llama.cpp runs

The families, both ways: GPT-2, Llama (3.x too), Qwen2/2.5, Qwen3, SmolLM3, Gemma 2 and 3, and
GPT-NeoX (its sequential block). The export writes the architecture the run has: GPT-2 (learned
positions, LayerNorm), GPT-NeoX (rotary, LayerNorm, a plain MLP), Qwen3 (rotary, RMSNorm, SwiGLU
and QK-norm), Llama (the same without QK-norm), or the others where their switches are set.

Exporting, and downloading a hub name, need the optional extra `hf` (transformers); importing a
local directory needs nothing more, because glassgpt reads it itself (safetensors only).
`--to-lens` writes what TransformerLens's HookedTransformer saved (config.json of its config's
fields, model.safetensors of its state_dict()'s tensors), ARENA's models (attention-only, no
norms, shortformer positions) too; it needs no extra (glassgpt.formats.transformer_lens).
`--to-gguf` writes llama.cpp's file (GPT-2, Llama, Qwen2 and Qwen3; matrices in f32, f16, bf16,
q8_0 or q4_0) with the run's tokenizer; it needs the optional extra `gguf` (glassgpt.formats.gguf).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from glassgpt.cli.common import add_checkpoint_flag, nonempty_arg, say
from glassgpt.config import GGUF_DTYPES, INSTALL_HINT
from glassgpt.errors import CommandLineError

# The handlers import torch, the model and the Hugging Face readers when they run (the work
# is glassgpt.formats.convert's), so that `convert --help` and a mistyped flag answer at once.
if TYPE_CHECKING:
    from glassgpt.config import GPTConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="import or export Hugging Face weights (GPT-2, Llama, Qwen, Gemma, NeoX)",
        description="Import a Hugging Face GPT-2, Llama, Qwen2/3, SmolLM3, Gemma 2/3 or "
                    "GPT-NeoX (hub name or save_pretrained directory) into a run directory, "
                    "or export a run to a save_pretrained directory of the architecture it has. "
                    f"Exporting, and downloading, need {INSTALL_HINT}. --to-lens exports a run "
                    "in TransformerLens's HookedTransformer format instead (config.json and "
                    "model.safetensors), which needs no extra; --to-gguf as one GGUF file for "
                    "llama.cpp, which needs the optional extra gguf.")
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR", type=nonempty_arg,
                        help="run directory to export (with --to-hf, --to-lens or --to-gguf)")
    parser.add_argument("--from-hf", metavar="NAME_OR_DIR", type=nonempty_arg,
                        help="hub model name (e.g. gpt2) or a save_pretrained directory of a "
                             "GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, ... "
                             "(docs/interop.md lists them)")
    parser.add_argument("--out", metavar="RUN_DIR", type=nonempty_arg,
                        help="new run directory for --from-hf")
    parser.add_argument("--to-hf", metavar="OUT_DIR", type=nonempty_arg,
                        help="new save_pretrained directory")
    parser.add_argument("--to-lens", metavar="OUT_DIR", type=nonempty_arg,
                        help="new directory of TransformerLens's checkpoint format: config.json "
                             "(HookedTransformerConfig's fields) and model.safetensors "
                             "(HookedTransformer.state_dict()'s tensors)")
    parser.add_argument("--circuit-tracer", action="store_true",
                        help="with --to-lens, also circuit_tracer.safetensors: the same tensors "
                             "under the names circuit-tracer's replacement model gives them "
                             "(ReplacementModel.from_config, then load_state_dict; "
                             "docs/interpretability.md)")
    parser.add_argument("--to-gguf", metavar="OUT.gguf", type=nonempty_arg,
                        help="new GGUF file for llama.cpp (GPT-2, Llama, Qwen2 or Qwen3 runs), "
                             "with the run's tokenizer and chat template")
    parser.add_argument("--dtype", choices=GGUF_DTYPES, default=None,
                        help="with --to-gguf, the type of the matrices: f32 (default), f16, "
                             "bf16, q8_0 or q4_0 (norms and biases stay f32)")
    parser.add_argument("--tokenizer", metavar="FILE", type=nonempty_arg,
                        help="tokenizer file for --from-hf when the model comes without one "
                             "(a tokenizer.json or a glassgpt tokenizer)")
    add_checkpoint_flag(parser, "export with --to-hf, --to-lens or --to-gguf")
    parser.add_argument("--force", action="store_true",
                        help="with --to-hf or --to-lens, replace an earlier export of that kind "
                             "glassgpt wrote in OUT_DIR (nothing else is replaced); with "
                             "--to-gguf, replace an earlier GGUF file at OUT.gguf")
    parser.add_argument("--adapter", action="store_true",
                        help="with --to-hf, a run fine-tuned with LoRA goes out as its base "
                             "model plus its adapter in peft's format (OUT_DIR/adapter); "
                             "without it the adapter is merged into one model")
    parser.add_argument("--dropout", type=float, default=None,
                        help="dropout of the imported model (default: the model's own)")
    parser.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    importing = args.from_hf is not None or args.out is not None
    targets = [flag for flag, value in (("--to-hf", args.to_hf), ("--to-lens", args.to_lens),
                                        ("--to-gguf", args.to_gguf)) if value is not None]
    exporting = args.run_dir is not None or bool(targets)
    if importing == exporting:
        raise CommandLineError("convert: give either --from-hf NAME_OR_DIR --out RUN_DIR, or "
                               "RUN_DIR --to-hf OUT_DIR")
    if args.adapter and args.to_hf is None:
        raise CommandLineError("convert: --adapter applies to --to-hf only (--to-lens and "
                               "--to-gguf write the adapter merged; an import has none)")
    if args.circuit_tracer and args.to_lens is None:
        raise CommandLineError("convert: --circuit-tracer applies to --to-lens only")
    if importing:
        if args.from_hf is None or args.out is None:
            raise CommandLineError("convert: --from-hf and --out go together")
        if args.force:
            raise CommandLineError("convert: --force applies to --to-hf, --to-lens and --to-gguf "
                                   "only (an import never replaces a run)")
        if args.dtype is not None:
            raise CommandLineError("convert: --dtype applies to --to-gguf only")
        return import_from_hf(args.from_hf, Path(args.out), args.tokenizer, args.dropout)
    if len(targets) > 1:
        raise CommandLineError(f"convert: give one of {', '.join(targets[:-1])} and "
                               f"{targets[-1]}, not {'both' if len(targets) == 2 else 'all'}")
    if args.run_dir is None or not targets:
        raise CommandLineError("convert: RUN_DIR and --to-hf (or --to-lens, --to-gguf) go "
                               "together")
    if args.tokenizer is not None or args.dropout is not None:
        raise CommandLineError("convert: --tokenizer and --dropout apply to --from-hf only")
    if args.dtype is not None and args.to_gguf is None:
        raise CommandLineError("convert: --dtype applies to --to-gguf only")
    if args.to_gguf is not None:
        return export_to_gguf(Path(args.run_dir), Path(args.to_gguf), args.checkpoint,
                              args.dtype or "f32", args.force)
    if args.to_lens is not None:
        return export_to_lens(Path(args.run_dir), Path(args.to_lens), args.checkpoint,
                              args.force, args.circuit_tracer)
    return export_to_hf(Path(args.run_dir), Path(args.to_hf), args.checkpoint, args.force,
                        args.adapter)


def _hide_hf_progress_bars() -> None:
    """transformers draws bars for copies that take milliseconds; one summary line is enough
    (asked where transformers works: importing it costs seconds that --to-gguf need not)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return  # interop raises the install hint when it needs transformers
    hf_logging.disable_progress_bar()


def import_from_hf(source: str, out: Path, tokenizer_file: str | None,
                   dropout: float | None) -> int:
    from glassgpt.formats.convert import import_run

    _hide_hf_progress_bars()
    imported = import_run(source, out, tokenizer_file, dropout)
    for note in imported.notes:
        say(f"note: {note}")
    c = imported.config
    print(f"wrote {out}: {_architecture_words(c)}, {c.n_layer} layers, {c.n_head} heads, "
          f"width {c.n_embd}, context {c.block_size}, vocabulary {c.vocab_size} "
          f"({imported.tokenizer_kind} tokenizer of {imported.tokenizer_size} tokens)")
    return 0


def _architecture_words(config: GPTConfig) -> str:
    """"GPT-2", or the switches of the others: "rope, rmsnorm, swiglu, 2 KV heads, qk_norm",
    and for Gemma "..., 15 of 18 layers local (window 512), post norms"."""
    if config.position == "learned":
        return "GPT-2"
    words = [config.position, config.norm, config.activation]
    if config.n_kv_head not in (None, config.n_head):
        words.append(f"{config.n_kv_head} KV heads")
    if config.qk_norm:
        words.append("qk_norm")
    if config.nope_layers:
        words.append(f"{len(config.nope_layers)} layers without rotary")
    local = sum(config.is_local(i) for i in range(config.n_layer))
    if local:
        words.append(f"{local} of {config.n_layer} layers local (window "
                     f"{config.sliding_window})")
    if config.post_norms:
        words.append("post norms")
    return ", ".join(words)


def export_to_hf(run_dir: Path, out: Path, checkpoint: str = "best", force: bool = False,
                 adapter: bool = False) -> int:
    from glassgpt.formats.convert import export_run

    _hide_hf_progress_bars()
    exported = export_run(run_dir, out, checkpoint, force, adapter)
    say(f"exporting {exported.weights}")
    if exported.with_tokenizer:
        chat = "" if exported.chat_end_of_turn is None else \
            f" with its chat template (a reply ends at {exported.chat_end_of_turn})"
        print(f"wrote {out}: model and tokenizer{chat} (load with "
              f"transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained)")
    else:
        print(f"wrote {out}: model only; its {exported.tokenizer_kind} tokenizer has no Hugging "
              f"Face equivalent, encode text with `glassgpt.tokenizers.load_tokenizer("
              f"'{run_dir / 'tokenizer.json'}')`")
    if exported.adapter is not None:
        print(f"wrote {exported.adapter}: the LoRA adapter in peft's format (load with "
              f"peft.PeftModel.from_pretrained(model, '{exported.adapter}'))")
    return 0


def export_to_gguf(run_dir: Path, out: Path, checkpoint: str = "best", dtype: str = "f32",
                   force: bool = False) -> int:
    from glassgpt.formats.gguf import export_gguf

    exported = export_gguf(run_dir, out, checkpoint, dtype, force)
    say(f"exporting {exported.weights}")
    for note in exported.notes:
        say(f"note: {note}")
    print(f"wrote {out}: GGUF, {exported.architecture} architecture, {exported.dtype} "
          f"matrices, {exported.tensors} tensors, {exported.bytes / 1e6:.1f} MB, "
          f"{exported.vocabulary} (run it with llama.cpp: llama-cli -m {out})")
    return 0


def export_to_lens(run_dir: Path, out: Path, checkpoint: str = "best", force: bool = False,
                   circuit_tracer: bool = False) -> int:
    from glassgpt.formats.transformer_lens_files import export_lens_run

    exported = export_lens_run(run_dir, out, checkpoint, force, circuit_tracer)
    say(f"exporting {exported.weights}")
    print(f"wrote {out}: config.json and model.safetensors in TransformerLens's format (load "
          f"with HookedGPT.from_lens_checkpoint, or HookedTransformer(HookedTransformerConfig("
          f"**config)).load_state_dict)")
    if circuit_tracer:
        print(f"wrote {out / 'circuit_tracer.safetensors'}: the same weights as circuit-tracer's "
              f"replacement model names them (ReplacementModel.from_config(cfg, transcoders)"
              f".load_state_dict(..., strict=False); docs/interpretability.md)")
    return 0
