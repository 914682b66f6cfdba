"""Run directories: everything needed to sample from a model or to resume its training exactly.

What a run directory holds is glassgpt.storage.layout's list (config.json, model.safetensors,
best.safetensors, tokenizer.json, train_state.*, metrics.jsonl, loss.png). `Run` opens one
once: its committed files resolved, config.json read and checked; it then hands out the
tokenizer, the best or last weights and the training state.
Tensors live in safetensors and everything else in JSON: loading a run never unpickles anything.
Every file is read through glassgpt.storage.files (no link followed, sizes and JSON bounded) and
glassgpt.storage.tensorfile (a safetensors header checked against config.json before any tensor is
allocated); weights holding NaN or infinities are refused where they enter. How the files are
committed, found while a commit is half done, and replaced is glassgpt.storage.commit's and
glassgpt.rundir.directory's business: loading a run never changes it. The model's tensors
(checked against config.json, read, and the GPT built around them) are glassgpt.rundir.weights'.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from glassgpt.adapters.lora import apply_run_adapter, bake_lora
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError, TokenizerError
from glassgpt.machine.devices import resolve_device
from glassgpt.machine.distributed import unwrap_model
from glassgpt.model import GPT
from glassgpt.rundir.directory import RUN_CONFIG_KEYS, RUN_FORMAT, commit_files, committed_paths
from glassgpt.rundir.snapshots import snapshot_path
from glassgpt.rundir.trainstate import (
    STATE_KEYS,
    TrainState,
    check_state_header,
    join_train_state,
    split_train_state,
)
from glassgpt.rundir.weights import check_fits_memory, model_holding, model_tensors, read_weights
from glassgpt.storage import files
from glassgpt.storage.layout import (
    ADAPTER_CONFIG_FILE,
    BEST_FILE,
    CHAT_TEMPLATE_FILE,
    CHECKPOINTS,
    CONFIG_FILE,
    METRICS_FILE,
    MODEL_FILE,
    RUN,
    SNAPSHOT_PREFIX,
    STATE_JSON_FILE,
    STATE_TENSORS_FILE,
    TOKENIZER_FILE,
    checkpoint_step,
)
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite
from glassgpt.tokenizers import Tokenizer, tokenizer_from_json
from glassgpt.tokenizers.chat import ChatTemplate

CONFIG_KEYS = RUN_CONFIG_KEYS
# Config, state and tokenizer files are small (GPT-2's tokenizer.json is 1.4 MB); a bigger one
# is refused before it is read, so a hostile file cannot exhaust memory.
MAX_JSON_BYTES = files.MAX_JSON_BYTES
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".pkl", ".bin")


# --- the run configuration -----------------------------------------------------------------

def run_config(model_config: GPTConfig, tokenizer: Tokenizer, train: dict | None = None,
               data_dir: str | None = None, extra: dict | None = None) -> dict[str, Any]:
    return {"format": RUN_FORMAT, "model": model_config.to_dict(), "train": train,
            "data_dir": data_dir, "tokenizer": tokenizer.kind, "extra": extra or {}}


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """config.json of a run, checked for its keys and a valid model config."""
    return _read_config(run_paths(run_dir)[CONFIG_FILE])


def _read_config(path: Path) -> dict[str, Any]:
    config = files.read_json_object(path, CheckpointError, MAX_JSON_BYTES)
    if "model_type" in config or "architectures" in config:
        raise CheckpointError(f"{path.parent} is a Hugging Face model directory, not a glassgpt "
                              f"run; import it with `glassgpt convert --from-hf {path.parent} "
                              f"--out RUN_DIR`")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown or "model" not in config:
        raise CheckpointError(f"{path}: unknown keys {unknown} or no 'model' table; "
                              f"expected keys {list(CONFIG_KEYS)}")
    _model_config(config, path)
    _check_config_types(config, path)
    return config


def _model_config(config: dict[str, Any], path: Path) -> GPTConfig:
    try:
        return GPTConfig.from_dict(config["model"])
    except ConfigError as error:
        raise CheckpointError(f"{path}: {error}") from None


def _check_config_types(config: dict[str, Any], path: Path) -> None:
    """The tables besides 'model' have the types the trainer and the CLI expect."""
    expected = {"train": (dict, None), "data_dir": (str, None), "tokenizer": (str, None),
                "extra": (dict,), "format": (str,)}
    for key, allowed in expected.items():
        value = config.get(key)
        if key in config and not (value is None and None in allowed
                                  or isinstance(value, tuple(t for t in allowed if t))):
            names = " or ".join("null" if t is None else t.__name__ for t in allowed)
            raise CheckpointError(f"{path}: {key!r} must be {names}, got {value!r:.80}")


def check_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` as a Path, after making sure it holds a checkpoint (nothing is changed)."""
    run_paths(run_dir)
    return Path(run_dir)


def run_paths(run_dir: str | Path) -> dict[str, Path]:
    """Where each file of the run's committed checkpoint is (see rundir.committed_paths),
    after making sure `run_dir` holds one. Reads, never writes."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise CheckpointError(f"{run_dir} is a file, not a run directory (glassgpt reads "
                              f"safetensors + JSON run directories and never loads pickle/.pt)")
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory not found: {run_dir}")
    paths = committed_paths(run_dir)
    if any(files.entry_kind(paths[name]) == "missing" for name in (CONFIG_FILE, MODEL_FILE)):
        _refuse_data_dir(run_dir)
        _refuse_pickles(run_dir)
        raise CheckpointError(f"{run_dir} holds no checkpoint (no {CONFIG_FILE} and "
                              f"{MODEL_FILE}); train first, or point at a run directory")
    return paths


def _refuse_data_dir(run_dir: Path) -> None:
    """Name a prepared data directory for what it is: its train.bin is token ids, not weights."""
    if files.entry_kind(run_dir / "meta.json") != "missing":
        raise CheckpointError(f"{run_dir} is a data directory (token ids from `glassgpt "
                              f"prepare`), not a run; train on it first: `glassgpt train "
                              f"--data {run_dir} --out RUN_DIR`, then use RUN_DIR")


def _refuse_pickles(run_dir: Path) -> None:
    """Name a legacy PyTorch checkpoint (nanoGPT's ckpt.pt, say): loading it would unpickle."""
    pickles = sorted(p.name for p in run_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{run_dir} holds a pickled checkpoint ({', '.join(pickles)}) and "
                              f"no {MODEL_FILE}; glassgpt never unpickles files (it could run "
                              f"code); convert it to safetensors where you trust it")


# --- a run, opened once ---------------------------------------------------------------------

class Run:
    """A run directory, opened once: where its committed files are, and config.json read and
    checked. Ask it for what the run holds; nothing is read twice, nothing is written.

        run = Run(path)
        model, tokenizer = run.load_model("cpu", checkpoint="best")
        print(run.describe_weights("best"), run.data_dir)
    """

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.paths = run_paths(self.dir)
        path = self.paths[CONFIG_FILE]
        self.config = _read_config(path)
        self.model_config = _model_config(self.config, path)
        self._tokenizer: Tokenizer | None = None

    @property
    def data_dir(self) -> Path | None:
        """The data directory the run trained on, as its config.json records it."""
        data_dir = self.config.get("data_dir")
        return None if data_dir is None else Path(data_dir)

    @property
    def train_settings(self) -> dict[str, Any]:
        return self.config.get("train") or {}

    @property
    def extra(self) -> dict[str, Any]:
        """What the run recorded about how it was started (preset, init_from, ...)."""
        return self.config.get("extra") or {}

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = _read_tokenizer(self.paths[TOKENIZER_FILE])
        return self._tokenizer

    def chat_template(self) -> ChatTemplate | None:
        """The chat template an imported instruct model came with, or None (a run trained
        here, or a base model's)."""
        path = self.paths[CHAT_TEMPLATE_FILE]
        if files.entry_kind(path) == "missing":
            return None
        text = files.read_text(path, MAX_JSON_BYTES, CheckpointError)
        data = files.parse_json(text, str(path), CheckpointError)
        try:
            return ChatTemplate.from_json(data, str(path))
        except TokenizerError as error:
            raise CheckpointError(str(error)) from None

    def weights_file(self, checkpoint: str = "best") -> tuple[str, Path]:
        """Which weights `checkpoint` ("best", "last" or a snapshot's "step:N") names, and
        where they are: the best ones when the run kept them (a trained run does from its first
        evaluation on), else the last (a converted run has only those); "step:1200" the
        snapshot kept at step 1200 (glassgpt.rundir.snapshots)."""
        step = selected_step(checkpoint)
        if step is not None:
            return f"{SNAPSHOT_PREFIX}{step}", snapshot_path(self.dir, step)
        if checkpoint == "best" and files.entry_kind(self.paths[BEST_FILE]) != "missing":
            return "best", self.paths[BEST_FILE]
        return "last", self.paths[MODEL_FILE]

    def describe_weights(self, checkpoint: str = "best") -> str:
        """One line saying which weights `load_model(checkpoint=...)` takes, e.g.
        "the best weights (val loss 1.4642 at iteration 1750)"."""
        used, _ = self.weights_file(checkpoint)
        if used.startswith(SNAPSHOT_PREFIX):
            return f"the snapshot at step {used.removeprefix(SNAPSHOT_PREFIX)}"
        state = self._state_summary()
        if used == "best" and state.get("best_iteration") is not None:
            return (f"the best weights (val loss {state['best_val_loss']:.4f} at iteration "
                    f"{state['best_iteration']})")
        if used == "best":
            return "the best weights"
        iteration = state.get("iteration")
        where = f" (iteration {iteration})" if isinstance(iteration, int) else ""
        fallback = " (the run kept no best ones)" if checkpoint == "best" else ""
        return f"the last weights{where}{fallback}"

    def _state_summary(self) -> dict[str, Any]:
        """train_state.json's small fields when the run has them, for messages only."""
        path = self.paths[STATE_JSON_FILE]
        with contextlib.suppress(CheckpointError):
            if files.entry_kind(path) != "missing":
                state = files.read_json_object(path, CheckpointError, MAX_JSON_BYTES)
                return {k: state.get(k) for k in ("iteration", "best_val_loss",
                                                  "best_iteration", "threads")}
        return {}

    def load_model(self, device: str | torch.device = "cpu", checkpoint: str = "best",
                   dtype: torch.dtype | None = None, adapter: bool = True
                   ) -> tuple[GPT, Tokenizer]:
        """The run's model, in eval mode on `device` (its weights as `dtype`, float32 unless
        given, read straight into it: a LoRA fine-tune's base kept in bf16 loads as float32
        too), and its tokenizer. A run holding a LoRA adapter (`adapter_dir`)
        gives its base with the adapter merged in, a plain GPT, unless `adapter` is False
        (then the base alone; a snapshot's weights are the adapted model's either way)."""
        target = resolve_device(str(device))
        used, weights = self.weights_file(checkpoint)
        tokenizer = self.tokenizer()
        if tokenizer.vocab_size > self.model_config.vocab_size:
            raise CheckpointError(f"{self.dir}: tokenizer has {tokenizer.vocab_size} tokens, "
                                  f"more than the model's vocab_size="
                                  f"{self.model_config.vocab_size}")
        tensors = read_weights(weights, self.model_config, dtype or torch.float32)
        model = model_holding(self.model_config, tensors, weights)
        del tensors  # the model holds them now
        # A snapshot of a LoRA fine-tune holds its adapters merged in already.
        if adapter and self.adapter_dir() is not None and used in CHECKPOINTS:
            apply_run_adapter(model, self.dir)
            bake_lora(model)
        return model.to(target).eval(), tokenizer

    def adapter_dir(self) -> Path | None:
        """The run directory itself when it holds a LoRA adapter beside its base weights (a
        LoRA fine-tune's adapter.json and adapter.safetensors: glassgpt.adapters.lora),
        else None."""
        return None if files.entry_kind(self.dir / ADAPTER_CONFIG_FILE) == "missing" else self.dir

    def has_train_state(self) -> bool:
        return _has_train_state(self.paths)

    def train_state(self, optimizer_shapes: dict[str, tuple[int, ...]] | None = None
                    ) -> TrainState:
        """The training state, checked before anything is allocated. `optimizer_shapes`
        (tensor name -> shape, e.g. `optimizer.0.exp_avg`) is what the optimizer that will
        take it holds; given, the file must hold exactly those."""
        if not self.has_train_state():
            raise CheckpointError(f"{self.dir} has no training state ({STATE_JSON_FILE}, "
                                  f"{STATE_TENSORS_FILE}); it can be sampled but not resumed "
                                  f"(use `train --init-from {self.dir}` to fine-tune it)")
        json_path = self.paths[STATE_JSON_FILE]
        state_json = files.read_json_object(json_path, CheckpointError, MAX_JSON_BYTES)
        unknown = sorted(set(state_json) - set(STATE_KEYS))
        if unknown:
            raise CheckpointError(f"{json_path}: unknown keys {unknown}")
        if optimizer_shapes is not None and state_json.get("iteration") == 0:
            optimizer_shapes = {}  # saved at step 0, before the optimizer's first step
        with SafetensorsFile(self.paths[STATE_TENSORS_FILE], CheckpointError) as file:
            check_state_header(file.header, optimizer_shapes, file.path)
            check_fits_memory(file.nbytes, f"the training state in {file.path}")
            tensors = file.read_all()
        check_finite(tensors, file.path, CheckpointError)
        try:
            return join_train_state(state_json, tensors)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            raise CheckpointError(f"{json_path}: malformed training state ({error})") from None


def selected_step(checkpoint: str) -> int | None:
    """The snapshot's step `checkpoint` names ("step:1200"), None for "best" and "last";
    ConfigError naming it for anything else."""
    try:
        return checkpoint_step(checkpoint)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def open_run(run: str | Path | Run) -> Run:
    """`run` itself when it is an open Run, else the run directory at that path, opened."""
    return run if isinstance(run, Run) else Run(run)


# --- the same, one call each -------------------------------------------------------------------

def weights_file(run_dir: str | Path | Run, checkpoint: str = "best") -> tuple[str, Path]:
    return open_run(run_dir).weights_file(checkpoint)


def describe_weights(run_dir: str | Path | Run, checkpoint: str = "best") -> str:
    return open_run(run_dir).describe_weights(checkpoint)


def load_model(run_dir: str | Path | Run, device: str | torch.device = "cpu",
               checkpoint: str = "best", dtype: torch.dtype | None = None,
               adapter: bool = True) -> tuple[GPT, Tokenizer]:
    """The model of a run directory, in eval mode on `device`, and its tokenizer.

    `checkpoint` "best" takes the weights of the run's best evaluation where it kept them
    (else the last), "last" the weights of its last checkpoint (`describe_weights` says which).
    A run holding a LoRA adapter gives its base with the adapter merged in, unless `adapter`
    is False.
    """
    return open_run(run_dir).load_model(device, checkpoint, dtype, adapter)


def read_tokenizer(run_dir: str | Path | Run) -> Tokenizer:
    return open_run(run_dir).tokenizer()


def _read_tokenizer(path: Path) -> Tokenizer:
    text = files.read_text(path, MAX_JSON_BYTES, CheckpointError)
    files.parse_json(text, str(path), CheckpointError)  # bounded first: depth, numbers
    try:
        return tokenizer_from_json(text, source=str(path))
    except TokenizerError as error:
        raise CheckpointError(str(error)) from None


def has_train_state(run_dir: str | Path) -> bool:
    return _has_train_state(committed_paths(run_dir))


def _has_train_state(paths: dict[str, Path]) -> bool:
    return all(files.entry_kind(paths[name]) != "missing"
               for name in (STATE_JSON_FILE, STATE_TENSORS_FILE))


def load_train_state(run_dir: str | Path | Run,
                     optimizer_shapes: dict[str, tuple[int, ...]] | None = None) -> TrainState:
    """The training state of a run (see `Run.train_state`)."""
    return open_run(run_dir).train_state(optimizer_shapes)


# --- writing -----------------------------------------------------------------------------------

def save_model(run_dir: str | Path, model: nn.Module, tokenizer: Tokenizer,
               extra: dict | None = None) -> None:
    """Write a run directory that `sample`, `eval` and `train --init-from` accept."""
    model = unwrap_model(model)
    config = run_config(model.config, tokenizer, extra=extra)
    commit_files(run_dir, {CONFIG_FILE: _json_bytes(config),
                           MODEL_FILE: _model_bytes(model),
                           TOKENIZER_FILE: tokenizer.to_json().encode("utf-8")})


def save_checkpoint(run_dir: str | Path, model: nn.Module, tokenizer: Tokenizer,
                    train_config: dict, data_dir: str | None, state: TrainState,
                    best: bool = False, extra: dict | None = None,
                    new_metrics: str | None = None,
                    weights: dict[str, Tensor] | None = None,
                    more_files: dict[str, bytes] | None = None) -> None:
    """Commit weights, config, tokenizer and training state together (all or nothing); with
    `best`, these weights are also the run's best (best.safetensors), in the same commit.

    With `new_metrics` (the text of metrics.jsonl so far), this is a new run's first commit:
    it writes metrics.jsonl afresh and removes every other own file of a run that was there
    before, in the same commit. So `train --force` replaces the old run only once the new
    one has a checkpoint: a crash before that leaves the old run whole.

    `weights`, when given, is the model's whole state dict (a sharded model's, gathered by
    glassgpt.training.fsdp.full_weights), written in place of `model.state_dict()`.
    `more_files` (a run's own names, such as chat_template.json) go in the same commit.
    """
    model = unwrap_model(model)
    config = run_config(model.config, tokenizer, train=train_config, data_dir=data_dir,
                        extra=extra)
    tensors, state_json = split_train_state(state)
    weights_bytes = _model_bytes(model, weights)
    contents = {CONFIG_FILE: _json_bytes(config), MODEL_FILE: weights_bytes,
                TOKENIZER_FILE: tokenizer.to_json().encode("utf-8"),
                STATE_TENSORS_FILE: save_safetensors_bytes(tensors),
                STATE_JSON_FILE: _json_bytes(state_json)}
    contents.update(more_files or {})
    if best:
        contents[BEST_FILE] = weights_bytes
    remove: tuple[str, ...] = ()
    if new_metrics is not None:
        contents[METRICS_FILE] = new_metrics.encode("utf-8")
        remove = tuple(name for name in RUN.files if name not in contents)
    commit_files(run_dir, contents, remove)


# --- files ---------------------------------------------------------------------------------

def _json_bytes(data: dict[str, Any]) -> bytes:
    try:
        text = json.dumps(data, indent=2, allow_nan=False)  # a NaN written could not be read
    except ValueError as error:
        raise CheckpointError(f"cannot save a checkpoint: a setting is NaN or infinite "
                              f"({error})") from None
    return (text + "\n").encode("utf-8")


def _model_bytes(model: nn.Module, state: dict[str, Tensor] | None = None) -> bytes:
    return save_safetensors_bytes(model_tensors(model, state), metadata={"format": "pt"})

