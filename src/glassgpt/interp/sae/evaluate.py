"""A dictionary's metrics on a run's data, as one library call: what `glassgpt sae eval` does.

    from glassgpt.interp.sae.evaluate import evaluate_on_run

    metrics = evaluate_on_run("saes/resid0", "runs/tiny", tokens=65_536)
    print(metrics.summary(), metrics.density_histogram(bins=10))

The run's model reads non-overlapping windows of a split of its data (or of `data`), as many as
`tokens` fill, eight at a time; the dictionary's metrics over them are SAELens's
(glassgpt.interp.sae.metrics). A dictionary glassgpt trained on another run's model is refused
unless `any_run` (glassgpt.interp.sae.provenance).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from glassgpt.data import PreparedData, sequential_batches
from glassgpt.errors import ConfigError
from glassgpt.interp.sae.metrics import DictionaryMetrics, evaluate_dictionary
from glassgpt.interp.sae.model import SAE
from glassgpt.interp.sae.provenance import check_trained_on
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.training import arguments

WINDOWS_PER_BATCH = 8
DEFAULT_CONTEXT = 128  # tokens a window holds when the dictionary records no context size


def evaluate_on_run(sae_dir: str | Path, run: str | Path | ckpt.Run, tokens: int = 65_536,
                    data: str | Path | None = None, split: str = "val",
                    device: str | torch.device = "cpu", checkpoint: str = "best",
                    any_run: bool = False, wording: str = "api",
                    progress: Callable[[int, int], None] | None = None) -> DictionaryMetrics:
    """The metrics of the dictionary saved in `sae_dir` (SAELens's format) on about `tokens`
    tokens of `split` of the run's data (`data`: another prepared data directory), its model's
    `checkpoint` weights on `device`. Windows hold the dictionary's context size, at most the
    model's. `progress(tokens_done, tokens_in_all)` is called before the first batch (0) and
    after each. Raises glassgpt.errors exceptions naming arguments as Python does, or as flags
    with `wording="cli"`."""
    spell = arguments.spelling(wording)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ConfigError(f"{spell('tokens')} must be positive, got {tokens}")
    run = ckpt.open_run(run)
    model, _ = run.load_model(device, checkpoint=checkpoint)
    sae = SAE.load(sae_dir, device=device)
    if not any_run:
        check_trained_on([(str(sae_dir), sae)], run, checkpoint,
                         f"evaluate it on that run, or pass {spell('any_run')} to use it here")
    data_dir = data or run.data_dir
    if data_dir is None:
        raise ConfigError(f"{run.dir} records no data directory; pass {spell('data')}")
    context = min(sae.cfg.metadata.context_size or DEFAULT_CONTEXT, model.config.block_size)
    ids = PreparedData(data_dir).splits[split]
    n_batches = -(-max(1, tokens // context) // WINDOWS_PER_BATCH)
    batches = sequential_batches(ids, context, WINDOWS_PER_BATCH, n_batches, device,
                                 model.config.vocab_size)
    if progress is not None:  # the windows sequential_batches draws, each `context` tokens
        windows = min((len(ids) - 1) // context, WINDOWS_PER_BATCH * n_batches)
        batches = reporting(batches, progress, windows * context)
    return evaluate_dictionary(model, sae, batches)


def reporting(batches: Iterable[tuple[Tensor, Tensor]], progress: Callable[[int, int], None],
              total: int) -> Iterator[tuple[Tensor, Tensor]]:
    """`batches` as they are, `progress(tokens done, total)` called before the first (when
    there is one) and as the next is asked for: when the one before was evaluated."""
    done = 0
    if total:
        progress(done, total)
    for x, y in batches:  # (B, T) each
        yield x, y
        done += x.numel()
        progress(done, total)
