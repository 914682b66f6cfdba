"""`train_dictionary`: a dictionary on a hook point of a run's model (or any glassgpt model),
from that run's prepared data, into a directory SAELens reads."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassgpt.data import PreparedData, cache_dir, prepare, sequential_batches, sha256_of
from glassgpt.data.datadir import holds_corpus
from glassgpt.errors import ConfigError, InputError
from glassgpt.interp.core.cache import unknown_name_message
from glassgpt.interp.core.hooked import as_glass, hook_points, run_with_cache
from glassgpt.interp.core.names import stop_at_layer
from glassgpt.interp.sae.metrics import evaluate_dictionary
from glassgpt.interp.sae.provenance import run_record
from glassgpt.interp.sae.training.activations import WindowActivations
from glassgpt.interp.sae.training.settings import DictionarySettings
from glassgpt.interp.sae.training.trainer import DictionaryResult, DictionaryTrainer, check_out
from glassgpt.machine.memory import gib, physical_memory
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.storage.layout import TOKENIZER_FILE

EVAL_SEED_OFFSET = 1_000_003


@dataclass
class DictionaryStart:
    """What a training is about to do, for its caller's start line: everything is checked and
    the model read; `step` is where it starts (0, or a resume's saved step) of settings.steps."""

    settings: DictionarySettings
    step: int
    d_in: int
    d_out: int
    context: int  # tokens per window the model reads


def train_dictionary(run_or_model: str | Path | ckpt.Run | nn.Module,
                     settings: DictionarySettings, out: str | Path, *,
                     data: str | Path | None = None, checkpoint: str = "best",
                     device: str | torch.device = "cpu", resume: bool = False,
                     force: bool = False,
                     report: Callable[[int, dict[str, Any]], None] | None = None,
                     stop: threading.Event | None = None,
                     on_start: Callable[[DictionaryStart], None] | None = None
                     ) -> DictionaryResult:
    """Train the dictionary `settings` describe on the model of a run directory (its
    `checkpoint` weights) or on a glassgpt model, reading windows of the train split of `data`
    (default: the run's data directory; a text file is tokenised with the run's tokenizer,
    see `prepared_text`) and reporting metrics on its val split: `report(step, record)` after
    every step, `on_start` once before the first (DictionaryStart). Everything is
    checked before anything is written: the hook names, the widths, whether `d_sae` fits in
    memory, `out` (see trainer.check_out), and for a resume its state and that it was trained
    on this run's model (glassgpt.interp.sae.provenance). Returns the trainer's result."""
    out = Path(out)
    check_out(out, force, resume)
    model, data_dir, metadata = model_and_data(run_or_model, data, checkpoint, device)
    prepared = PreparedData(data_dir)
    if isinstance(run_or_model, str | Path | ckpt.Run):
        from glassgpt.training.runs import check_same_tokenizer
        check_same_tokenizer(prepared, run_or_model)
    context = min(settings.context, model.config.block_size)
    d_in, d_out = check_hooks(model, settings, context, device)
    check_fits_memory(settings, d_in, d_out)
    source = WindowActivations(model, settings.hook, settings.target_hook,
                               prepared.splits["train"], context, settings.batch_tokens,
                               settings.seed, device)
    held_out = list(sequential_batches(prepared.splits["val"], context, settings.eval_windows,
                                       1, device, model.config.vocab_size))

    def evaluate(sae: Any) -> Any:
        return evaluate_dictionary(model, sae, held_out) if held_out else None

    trainer = DictionaryTrainer(settings, source, d_in, d_out, out, evaluate=evaluate,
                                metadata={**metadata, "context_size": context},
                                device=device, report=report, stop=stop)
    if resume:
        trainer.resume()
    if on_start is not None:
        on_start(DictionaryStart(settings, trainer.step, d_in, d_out, context))
    return trainer.run()


def model_and_data(run_or_model: Any, data: str | Path | None, checkpoint: str,
                    device: str | torch.device) -> tuple[nn.Module, Path, dict[str, Any]]:
    if isinstance(run_or_model, nn.Module):
        if data is None:
            raise ConfigError("a model without its run needs data= (a prepared data directory)")
        if Path(data).is_file():
            raise ConfigError(f"{data} is a text file; a model without its run has no "
                              f"tokenizer to read it with: give the run, or prepared data")
        return as_glass(run_or_model).to(device).eval(), Path(data), {"model_name": "glassgpt"}
    run = ckpt.open_run(run_or_model)
    model, _ = run.load_model(device, checkpoint=checkpoint)
    data_dir = data or run.data_dir
    if data_dir is None:
        raise ConfigError(f"{run.dir} records no data directory; pass --data")
    if Path(data_dir).is_file():
        data_dir = prepared_text(Path(data_dir), run)
    return model, Path(data_dir), run_record(run, checkpoint)


def prepared_text(text: Path, run: ckpt.Run) -> Path:
    """A text file tokenised with the run's tokenizer, by glassgpt's data pipeline (streamed
    through in pieces, the ids written to disk and memory-mapped, never all in memory), into
    glassgpt's cache: once per text and tokenizer, again only when the text changes. Its last
    tenth is the held-out split the metrics read."""
    tokenizer_key = hashlib.sha256(run.tokenizer().to_json().encode("utf-8")).hexdigest()
    text_key = sha256_of(text)
    data_dir = cache_dir() / "data" / f"sae-text-{text_key[:16]}-{tokenizer_key[:16]}"
    if not holds_corpus(data_dir, text_key):
        prepare(data_dir, text, tokenizer_file=run.paths[TOKENIZER_FILE], force=True)
    return data_dir


def check_hooks(model: nn.Module, settings: DictionarySettings, context: int,
                device: str | torch.device) -> tuple[int, int]:
    """(d_in, d_out): the widths of the settings' points in a one-window probe, each point
    refused by name (with the closest names) when the model lacks it."""
    points = hook_points(model)
    for name in settings.hooks:
        if name not in points:
            raise InputError(unknown_name_message(name, points, "the model"))
    order = list(points)
    if settings.transcoder and order.index(settings.hook) > order.index(settings.target_hook):
        raise InputError(f"the transcoder reads {settings.hook}, which the model computes "
                         f"after {settings.hook_out}")
    probe = torch.zeros(1, 1, dtype=torch.long, device=device)
    stop = stop_at_layer(settings.hooks, as_glass(model).config.n_layer)
    _, cache = run_with_cache(model, probe, settings.hooks, stop)
    widths = []
    for name in (settings.hook, settings.target_hook):
        if cache[name].dim() != 3:
            raise InputError(f"{name} has shape {tuple(cache[name].shape)} per window: a "
                             f"dictionary reads a (batch, position, width) point")
        widths.append(cache[name].shape[-1])
    return widths[0], widths[1]


def training_bytes(settings: DictionarySettings, d_in: int, d_out: int) -> int:
    """float32 bytes of a training: weights, gradients and Adam's two moments of W_enc and
    W_dec, and a batch's (N, d_sae) pre-activations, latents and their gradients."""
    weights = settings.d_sae * (d_in + d_out)
    return 4 * (4 * weights + 6 * settings.batch_tokens * settings.d_sae)


def check_fits_memory(settings: DictionarySettings, d_in: int, d_out: int) -> None:
    needed, available = training_bytes(settings, d_in, d_out), physical_memory()
    if available is not None and needed > available:
        raise ConfigError(f"d_sae={settings.d_sae} needs about {gib(needed)} of memory to "
                          f"train (batch_tokens={settings.batch_tokens}), more than this "
                          f"machine's {gib(available)}")


