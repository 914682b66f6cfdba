"""`train_crosslayer`: a cross-layer transcoder over every MLP of a run's model (or any
glassgpt model), from that run's prepared data, into a directory circuit-tracer reads
(`glassgpt sae train-clt`)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from glassgpt.data import BatchSampler, PreparedData, sequential_batches
from glassgpt.errors import InputError
from glassgpt.interp.core.cache import unknown_name_message
from glassgpt.interp.core.hooked import as_glass, hook_points, run_with_cache
from glassgpt.interp.sae.circuit_tracer_clt import clt_files
from glassgpt.interp.sae.crosslayer_metrics import evaluate_crosslayer
from glassgpt.interp.sae.training.activations import check_finite_activations
from glassgpt.interp.sae.training.crosslayer_settings import CrossLayerSettings
from glassgpt.interp.sae.training.crosslayer_trainer import CrossLayerResult, CrossLayerTrainer
from glassgpt.interp.sae.training.run import model_and_data
from glassgpt.interp.sae.training.state import STATE_JSON, STATE_TENSORS
from glassgpt.interp.sae.training.trainer import check_out
from glassgpt.machine.memory import gib, physical_memory
from glassgpt.rundir import checkpoint as ckpt


@dataclass
class CrossLayerStart:
    """What a training is about to do, for its caller's start line (everything checked, the
    model read): `step` is where it starts, of settings.steps."""

    settings: CrossLayerSettings
    step: int
    n_layers: int
    d_model: int
    context: int


class LayerActivations:
    """Random windows of a split, run through the model under no_grad: each step's batch is
    every layer's input and output point at `batch_tokens` positions, x and y (L, N, d)."""

    def __init__(self, model: nn.Module, settings: CrossLayerSettings, n_layers: int,
                 ids: np.ndarray, context: int, device: torch.device | str):
        self.model, self.batch_tokens = model, settings.batch_tokens
        self.inputs = [settings.input_hook(layer) for layer in range(n_layers)]
        self.outputs = [settings.output_hook(layer) for layer in range(n_layers)]
        self.sampler = BatchSampler(ids, context, math.ceil(self.batch_tokens / context),
                                    settings.seed, device, vocab_size=model.config.vocab_size)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        ids, _ = self.sampler.next_batch()  # (B, T)
        _, cache = run_with_cache(self.model, ids, self.inputs + self.outputs)
        n = self.batch_tokens
        x = torch.stack([cache[name].flatten(0, -2)[:n] for name in self.inputs])  # (L, N, d)
        y = torch.stack([cache[name].flatten(0, -2)[:n] for name in self.outputs])
        check_finite_activations(x, "the CLT's input points")
        check_finite_activations(y, "the CLT's output points")
        return x, y

    def get_state(self) -> Tensor:
        return self.sampler.get_state()

    def set_state(self, state: Tensor) -> None:
        self.sampler.set_state(state)


def train_crosslayer(run_or_model: str | Path | ckpt.Run | nn.Module,
                     settings: CrossLayerSettings, out: str | Path, *,
                     data: str | Path | None = None, checkpoint: str = "best",
                     device: str | torch.device = "cpu", resume: bool = False,
                     force: bool = False,
                     report: Callable[[int, dict[str, Any]], None] | None = None,
                     stop: threading.Event | None = None,
                     on_start: Callable[[CrossLayerStart], None] | None = None
                     ) -> CrossLayerResult:
    """Train the CLT `settings` describe on every MLP of a run's model (its `checkpoint`
    weights) or of a glassgpt model, reading windows of the train split of `data` (default:
    the run's data; a text file is tokenised with the run's tokenizer) and reporting the
    metrics of glassgpt.interp.sae.crosslayer_metrics on its val split. Everything is checked
    before anything is written (as train_dictionary checks it)."""
    out = Path(out)
    check_out(out, force, resume, clt_own_files, "CLT")
    model, data_dir, metadata = model_and_data(run_or_model, data, checkpoint, device)
    prepared = PreparedData(data_dir)
    if isinstance(run_or_model, str | Path | ckpt.Run):
        from glassgpt.training.runs import check_same_tokenizer
        check_same_tokenizer(prepared, run_or_model)
    config = as_glass(model).config
    context = min(settings.context, config.block_size)
    n_layers, d_model = check_points(model, settings, config.n_layer)
    check_clt_fits_memory(settings, n_layers, d_model)
    source = LayerActivations(model, settings, n_layers, prepared.splits["train"], context,
                              device)
    held_out = list(sequential_batches(prepared.splits["val"], context, settings.eval_windows,
                                       1, device, config.vocab_size))

    def evaluate(clt: Any) -> Any:
        return evaluate_crosslayer(model, clt, held_out) if held_out else None

    trainer = CrossLayerTrainer(settings, source, n_layers, d_model, out, evaluate=evaluate,
                                metadata={**metadata, "context_size": context}, device=device,
                                report=report, stop=stop)
    if resume:
        trainer.resume()
    if on_start is not None:
        on_start(CrossLayerStart(settings, trainer.step, n_layers, d_model, context))
    return trainer.run()


def check_points(model: nn.Module, settings: CrossLayerSettings, n_layers: int
                 ) -> tuple[int, int]:
    """(n_layers, d_model): every layer has the input and output points, one width."""
    points = hook_points(model)
    names = [settings.input_hook(layer) for layer in range(n_layers)] + \
        [settings.output_hook(layer) for layer in range(n_layers)]
    for name in names:
        if name not in points:
            raise InputError(unknown_name_message(name, points, "the model"))
    _, cache = run_with_cache(model, torch.zeros(1, 1, dtype=torch.long,
                                                 device=next(model.parameters()).device), names)
    widths = {cache[name].shape[-1] for name in names if cache[name].dim() == 3}
    if len(widths) != 1 or any(cache[name].dim() != 3 for name in names):
        raise InputError(f"a CLT reads and writes one width at every layer; "
                         f"{settings.input_point} and {settings.output_point} have "
                         f"{sorted(widths)}")
    return n_layers, widths.pop()


def check_clt_fits_memory(settings: CrossLayerSettings, n_layers: int, d_model: int) -> None:
    """float32 bytes: weights, gradients, Adam's two moments (encoders L * d * F, decoders
    L (L + 1) / 2 * F * d) and a batch's pre-activations, features and their gradients."""
    weights = settings.d_transcoder * d_model * (n_layers + n_layers * (n_layers + 1) // 2)
    needed = 4 * (4 * weights + 6 * settings.batch_tokens * n_layers * settings.d_transcoder)
    available = physical_memory()
    if available is not None and needed > available:
        raise InputError(f"d_transcoder={settings.d_transcoder} needs about {gib(needed)} to "
                         f"train over {n_layers} layers, more than this machine's "
                         f"{gib(available)}")


def clt_own_files(out: Path) -> set[str]:
    """The names a CLT training writes into `out`: its layers' files and the trainer's state."""
    n = len(list(out.glob("W_enc_*.safetensors"))) if out.is_dir() else 0
    return clt_files(n) | {STATE_JSON, STATE_TENSORS}
