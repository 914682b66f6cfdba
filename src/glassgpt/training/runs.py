"""Setting up runs, as a library: everything `glassgpt train`, `sample` and `eval` decide before
the work starts, printing nothing.

  * settings: a preset, then a TOML file (`--config`), then flags (`resolve_configs`);
  * the model to train: fresh (`build_model`), or a run's weights to fine-tune
    (`model_for_finetuning`), or a run to continue (`resume_settings`);
  * the data: a prepared directory, or Tiny Shakespeare prepared once into the cache
    (`training_data`), whose tokenizer must do what the run's does (`check_same_tokenizer`);
  * evaluating a run on a split of its data (`evaluate_run`).
Run directories themselves (claiming, replacing, locking) are `glassgpt.rundir.directory`; the whole
lifecycle of `glassgpt train` (start, resume, fine-tune) is `glassgpt.training.lifecycle.train_run`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from glassgpt.config import GPTConfig, TrainConfig, load_preset
from glassgpt.data import PreparedData, default_data_dir, prepared_tinyshakespeare
from glassgpt.errors import CheckpointError, ConfigError, DataError
from glassgpt.machine import distributed as ddp
from glassgpt.machine.devices import AUTO, autocast_dtype, resolve_device
from glassgpt.machine.memory import check_model_fits_memory, check_training_fits_memory
from glassgpt.model import GPT, parameter_count
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.storage import files
from glassgpt.storage.layout import CONFIG_FILE, TOKENIZER_FILE
from glassgpt.tokenizers import same_tokenizer
from glassgpt.training.evaluate import Evaluation, eval_batch_size, eval_context, evaluate

CONFIG_TABLES = ("model", "train")


# --- settings --------------------------------------------------------------------------------

def read_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """A TOML file with optional [model] and [train] tables (the presets' layout), read with
    files.read_toml's bounds. The user named it: a link to it is followed, on purpose."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    tables = files.read_toml(path.resolve(), ConfigError)
    unknown = sorted(set(tables) - set(CONFIG_TABLES))
    if unknown:
        raise ConfigError(f"{path}: unknown tables {unknown}; use [model] and [train]")
    for name, table in tables.items():
        if not isinstance(table, dict):  # `model = 5`, or `[[model]]` (an array of tables)
            raise ConfigError(f"{path}: {name} must be a [{name}] table of settings, got "
                              f"{table!r:.60}")
    return tables


def resolve_configs(preset: str, config_file: str | Path | None, model_flags: dict[str, Any],
                    train_flags: dict[str, Any]) -> tuple[dict[str, Any], TrainConfig]:
    """Settings in order of precedence: flags > --config file > preset > defaults."""
    tables = load_preset(preset)
    from_file = read_config_file(config_file) if config_file else {}
    model = {**tables.get("model", {}), **from_file.get("model", {}), **model_flags}
    train = {**tables.get("train", {}), **from_file.get("train", {}), **train_flags}
    return model, TrainConfig.from_dict(train)


def model_overrides(config_file: str | Path | None, model_flags: dict[str, Any]
                    ) -> dict[str, Any]:
    """The model settings a user asked for: the config file's [model] table, then flags."""
    from_file = read_config_file(config_file) if config_file else {}
    return {**from_file.get("model", {}), **model_flags}


def preset_for_device(device: str) -> str:
    """The default recipe: `shakespeare-char` where a GPU trains it in minutes, else the
    `cpu-small` model that a CPU trains in a few minutes."""
    return "shakespeare-char" if resolve_device(device).type == "cuda" else "cpu-small"


def fresh_run_dir(parent: Path = Path("runs")) -> Path:
    """runs/<time>, a name no directory has yet."""
    run_dir = parent / time.strftime("%Y%m%d-%H%M%S")
    while run_dir.exists():
        run_dir = run_dir.with_name(run_dir.name + "-1")
    return run_dir


# --- the model and its data ------------------------------------------------------------------

def training_data(data_dir: Path | None, context: ddp.DistContext) -> PreparedData:
    """`data_dir`, or Tiny Shakespeare prepared once (character level) into the cache: by rank
    0, while the other ranks wait, so that no two processes write it."""
    if data_dir is not None:
        return PreparedData(data_dir)
    if context.is_main:
        prepared_tinyshakespeare()
    ddp.barrier(context)
    return PreparedData(default_data_dir())


def build_model(model_settings: dict[str, Any], vocab_size: int, seed: int,
                training: TrainConfig | None = None, local_rank: int = 0) -> GPT:
    """A freshly initialised GPT; the vocabulary size comes from the data's tokenizer. With
    `training`, a job whose training step cannot fit the device is refused before the model
    is built (building a huge one alone takes minutes)."""
    config = GPTConfig.from_dict({**model_settings, "vocab_size": vocab_size})
    parameters = parameter_count(config)
    check_model_fits_memory(config, parameters)
    if training is not None:
        device = resolve_device(training.device, local_rank)
        check_training_fits_memory(config, training.batch_size,
                                   autocast_dtype(training.dtype, device), device, parameters)
    torch.manual_seed(seed)  # the same initial weights on every rank
    return GPT(config)


def check_same_tokenizer(data: PreparedData, run: str | Path | ckpt.Run) -> None:
    """Refuse data prepared with a tokenizer that does something else than the run's: the ids
    would mean nothing. Tokenizers are compared by what they do (vocabulary, merges, probe
    encodings), so a copy that another tool rewrote (transformers adds a no-op post-processor)
    is still the same one."""
    run = ckpt.open_run(run)
    if not same_tokenizer(data.tokenizer, run.tokenizer()):
        raise DataError(f"the data's tokenizer differs from the one of {run.dir}; prepare the "
                        f"text with --tokenizer-file {run.dir / TOKENIZER_FILE}")


def model_for_finetuning(init_from: str | Path | ckpt.Run, data: PreparedData,
                         model_settings: dict[str, Any], checkpoint: str = "best") -> GPT:
    """The model of run `init_from` (its best weights by default), in train mode, to train
    further on `data`.

    Its shape is fixed by its weights; only `dropout` among `model_settings` (a config file's
    [model] table and flags, see `model_overrides`) may differ.
    """
    unknown = sorted(set(model_settings) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise ConfigError(f"unknown model config keys {unknown}")
    source = ckpt.open_run(init_from)
    model, _ = source.load_model(checkpoint=checkpoint)
    check_same_tokenizer(data, source)
    changed = {k for k, v in model_settings.items() if k != "dropout"
               and getattr(model.config, k) != v}
    if changed:
        raise ConfigError(f"--init-from {source.dir}: its model settings are fixed; only "
                          f"dropout may change (got {sorted(changed)})")
    if "dropout" in model_settings:
        fresh = GPT(dataclasses.replace(model.config, dropout=model_settings["dropout"]))
        fresh.load_state_dict(model.state_dict())
        model = fresh
    return model.train()


def resume_settings(run_dir: str | Path, model_flags: dict[str, Any],
                    train_flags: dict[str, Any]) -> tuple[TrainConfig, Path | None]:
    """The training settings to continue the run in `run_dir` with, and its data directory
    (None when the run records none).

    Training settings may change (`train_flags` override the run's); model settings may not.
    """
    run = ckpt.open_run(run_dir)
    config = run.config
    if not run.has_train_state():
        run.train_state()  # raises the error that explains what to do
    changed = {k: v for k, v in model_flags.items() if config["model"].get(k) != v}
    if changed:
        asked = ", ".join(f"{k}={v} (the run has {config['model'].get(k)})"
                          for k, v in sorted(changed.items()))
        raise ConfigError(f"cannot change model settings of a run when resuming: {asked}; "
                          f"start a new run with --init-from {run_dir}")
    saved = config["train"] or {}
    try:
        TrainConfig.from_dict(saved)
    except ConfigError as error:
        raise CheckpointError(f"{run.dir / CONFIG_FILE}: its 'train' table is not "
                              f"valid: {error}") from None
    cfg = TrainConfig.from_dict({**saved, **train_flags})
    data_dir = config.get("data_dir")
    return cfg, None if data_dir is None else Path(data_dir)


# --- evaluating a run -------------------------------------------------------------------------

def evaluate_run(run_dir: str | Path, split: str = "val", data_dir: str | Path | None = None,
                 batch_size: int | None = None, max_batches: int = 200,
                 device: torch.device | str = "cpu", checkpoint: str = "best",
                 threads: int | str | None = AUTO,
                 progress: Callable[[int, int], Any] | None = None,
                 context: int | None = None) -> Evaluation:
    """Loss, perplexity and bits per byte of a run's model on non-overlapping windows of a
    split of its data (or of `data_dir`, prepared with the same tokenizer). `run_dir` may be
    an open `checkpoint.Run`: the directory is resolved once. `threads`: a CPU thread count,
    "auto" (timed on the batches) or None; the result says which count ran. `context`: the
    window's tokens (default `evaluate.eval_context`'s: the model's, at most 2,048);
    `batch_size` None is `evaluate.eval_batch_size`'s (32, fewer for a large vocabulary).
    A fine-tuned run without `data_dir` is scored on its conversations
    (finetune_eval.evaluate_conversations)."""
    if (batch_size is not None and batch_size <= 0) or max_batches <= 0:
        raise ConfigError(f"batch size and max batches must be positive, got {batch_size} "
                          f"and {max_batches}")
    run = ckpt.open_run(run_dir)
    if data_dir is None and run.extra.get("sft") is not None:  # a fine-tune: its conversations
        from glassgpt.training.finetune_eval import evaluate_conversations

        return evaluate_conversations(run, split, batch_size, max_batches, device, checkpoint,
                                      threads, progress, context)
    model, _ = run.load_model(device, checkpoint=checkpoint)
    data_dir = data_dir or run.data_dir
    if data_dir is None:
        raise ConfigError(f"{run.dir} records no data directory; pass --data")
    data = PreparedData(data_dir)
    check_same_tokenizer(data, run)
    window = eval_context(model.config.block_size, context)
    data.check_block_size(window)
    if batch_size is None:
        batch_size = eval_batch_size(window, model.config.vocab_size)
    return evaluate(model, data.splits[split], data.tokenizer, batch_size, max_batches, device,
                    threads=threads, progress=progress, context=window)
