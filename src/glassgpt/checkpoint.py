"""Run directories: everything needed to sample from a model or to resume its training exactly.

A run directory holds
    config.json               model config, training config, data directory, tokenizer kind
    model.safetensors         weights of the unwrapped model (a tied matrix stored once)
    tokenizer.json            the tokenizer the model was trained with
    train_state.safetensors   optimizer tensors and RNG states          } only for runs that
    train_state.json          iteration, best val loss, the rest        } can be resumed
    metrics.jsonl, loss.png   written by the trainer
Tensors live in safetensors and everything else in JSON: loading a run never unpickles anything.

A checkpoint is several files, so it is committed like a tiny database transaction: every file is
first written in full under a `.pending` name, then a journal naming them is written atomically,
then each is renamed into place. A crash before the journal leaves the old checkpoint whole; a
crash after it is finished (rolled forward) the next time the run is opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError, TokenizerError
from glassgpt.files import fsync_dir, write_text_atomic
from glassgpt.model import GPT
from glassgpt.tokenizers import Tokenizer, tokenizer_from_json

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
JOURNAL_FILE = "checkpoint.journal"
PENDING_SUFFIX = ".pending"
RUN_FORMAT = "glassgpt-run/1"
CONFIG_KEYS = ("format", "model", "train", "data_dir", "tokenizer", "extra")
STATE_KEYS = ("iteration", "best_val_loss", "optimizer", "rng", "scaler")
CHECKPOINT_FILES = (CONFIG_FILE, MODEL_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE)
# Config, state and tokenizer files are small (GPT-2's tokenizer.json is 1.4 MB); a bigger one
# is refused before it is read, so a hostile file cannot exhaust memory.
MAX_JSON_BYTES = 64 * 2**20
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".pkl", ".bin")


# --- the model -----------------------------------------------------------------------------

def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP (`.module`) and `torch.compile` (`._orig_mod`) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The weights to write: no wrapper prefixes, and a tied LM head stored once (as tok_emb)."""
    model = unwrap_model(model)
    state = model.state_dict()
    if getattr(model.config, "tie_weights", False):
        state.pop("lm_head.weight", None)
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def load_model_tensors(model: GPT, tensors: dict[str, Tensor], path: Path) -> None:
    """Copy `tensors` into `model`, after checking names and shapes against its config."""
    _check_tensor_shapes(model.config, model.state_dict(), tensors, path)
    # strict=False only because a tied lm_head.weight is absent; it stays tied to tok_emb.
    model.load_state_dict(tensors, strict=False)


def _check_tensor_shapes(config: GPTConfig, model_state: dict[str, Tensor],
                         tensors: dict[str, Tensor], path: Path) -> None:
    expected = {name: t.shape for name, t in model_state.items()}
    if config.tie_weights:
        expected.pop("lm_head.weight")  # the same tensor as tok_emb.weight, stored once
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: tensors do not match config.json "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}"
                                  f", config.json needs {tuple(shape)}")


# --- the run configuration -----------------------------------------------------------------

def run_config(model_config: GPTConfig, tokenizer: Tokenizer, train: dict | None = None,
               data_dir: str | None = None, extra: dict | None = None) -> dict[str, Any]:
    return {"format": RUN_FORMAT, "model": model_config.to_dict(), "train": train,
            "data_dir": data_dir, "tokenizer": tokenizer.kind, "extra": extra or {}}


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """config.json of a run, checked for its keys and a valid model config."""
    run_dir = check_run_dir(run_dir)
    path = run_dir / CONFIG_FILE
    config = _read_json(path)
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown or "model" not in config:
        raise CheckpointError(f"{path}: unknown keys {unknown} or no 'model' table; "
                              f"expected keys {list(CONFIG_KEYS)}")
    try:
        GPTConfig.from_dict(config["model"])
    except ConfigError as error:
        raise CheckpointError(f"{path}: {error}") from None
    _check_config_types(config, path)
    return config


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
    """`run_dir` as a Path, after making sure it is a run directory (and finishing a commit)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise CheckpointError(f"{run_dir} is a file, not a run directory (glassgpt reads "
                              f"safetensors + JSON run directories and never loads pickle/.pt)")
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory not found: {run_dir}")
    recover_interrupted_commit(run_dir)
    if not (run_dir / CONFIG_FILE).is_file() or not (run_dir / MODEL_FILE).is_file():
        _refuse_pickles(run_dir)
        raise CheckpointError(f"{run_dir} holds no checkpoint (no {CONFIG_FILE} and "
                              f"{MODEL_FILE}); train first, or point at a run directory")
    return run_dir


def _refuse_pickles(run_dir: Path) -> None:
    """Name a legacy PyTorch checkpoint (nanoGPT's ckpt.pt, say): loading it would unpickle."""
    pickles = sorted(p.name for p in run_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{run_dir} holds a pickled checkpoint ({', '.join(pickles)}) and "
                              f"no {MODEL_FILE}; glassgpt never unpickles files (it could run "
                              f"code); convert it to safetensors where you trust it")


# --- public API ----------------------------------------------------------------------------

def save_model(run_dir: str | Path, model: nn.Module, tokenizer: Tokenizer,
               extra: dict | None = None) -> None:
    """Write a run directory that `sample`, `eval` and `train --init-from` accept."""
    model = unwrap_model(model)
    config = run_config(model.config, tokenizer, extra=extra)
    commit_files(run_dir, {CONFIG_FILE: _json_bytes(config),
                           MODEL_FILE: _model_bytes(model),
                           TOKENIZER_FILE: tokenizer.to_json().encode("utf-8")})


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer]:
    """The model of a run directory, in eval mode on `device`, and its tokenizer."""
    run_dir = check_run_dir(run_dir)
    config = GPTConfig.from_dict(read_run_config(run_dir)["model"])
    tokenizer = read_tokenizer(run_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{run_dir}: tokenizer has {tokenizer.vocab_size} tokens, more "
                              f"than the model's vocab_size={config.vocab_size}")
    path = run_dir / MODEL_FILE
    tensors = read_safetensors(path)
    check_config_fits_tensors(config, tensors, path)
    model = GPT(config)
    load_model_tensors(model, tensors, path)
    return model.to(device).eval(), tokenizer


def check_config_fits_tensors(config: GPTConfig, tensors: dict[str, Tensor], path: Path) -> None:
    """Compare config.json with the weights before allocating anything: a config that asks for
    a huge model (vocab_size=10**12, say) is refused instead of exhausting memory."""
    if config.n_layer > len(tensors):  # every layer has at least one tensor
        raise CheckpointError(f"{path}: config.json asks for n_layer={config.n_layer}, but the "
                              f"file holds only {len(tensors)} tensors")
    try:
        with torch.device("meta"):  # shapes only, no memory
            expected = GPT(config).state_dict()
    except RuntimeError as error:  # sizes whose product overflows
        raise CheckpointError(f"{path}: config.json asks for tensors too large to exist "
                              f"({error})") from None
    _check_tensor_shapes(config, expected, tensors, path)


def read_tokenizer(run_dir: Path) -> Tokenizer:
    path = run_dir / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return tokenizer_from_json(_read_small_text(path), source=str(path))
    except TokenizerError as error:
        raise CheckpointError(str(error)) from None
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path} is not UTF-8 text ({error})") from None


# --- training state ------------------------------------------------------------------------

@dataclass
class TrainState:
    """Everything besides the weights that exact resumption needs."""

    iteration: int = 0
    best_val_loss: float = float("inf")
    optimizer: dict[str, Any] = field(default_factory=dict)  # torch optimizer state_dict
    rng: list[dict[str, Any]] = field(default_factory=list)  # one capture_rng_state per rank
    scaler: dict[str, Any] | None = None  # GradScaler state (fp16 on CUDA only)


def capture_rng_state(sampler_state: Tensor) -> dict[str, Any]:
    """Random states of python, numpy, torch (CPU and CUDA) and the batch sampler."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss = random.getstate()
    return {"python": [version, list(mt), gauss],
            "numpy": {"keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "sampler": sampler_state}


def restore_rng_state(rng: dict[str, Any]) -> Tensor:
    """Set the global random states saved by `capture_rng_state`; returns the sampler's."""
    try:
        return _restore_rng_state(rng)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:
        raise CheckpointError(f"{STATE_JSON_FILE}: the saved random states are malformed "
                              f"({error!r:.200})") from None


def _restore_rng_state(rng: dict[str, Any]) -> Tensor:
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    numpy_state = rng["numpy"]
    np.random.set_state(("MT19937", np.array(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"],
                         numpy_state["cached_gaussian"]))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return rng["sampler"]


def save_checkpoint(run_dir: str | Path, model: nn.Module, tokenizer: Tokenizer,
                    train_config: dict, data_dir: str | None, state: TrainState) -> None:
    """Commit weights, config, tokenizer and training state together (all or nothing)."""
    model = unwrap_model(model)
    config = run_config(model.config, tokenizer, train=train_config, data_dir=data_dir)
    tensors, state_json = _split_train_state(state)
    commit_files(run_dir, {CONFIG_FILE: _json_bytes(config),
                           MODEL_FILE: _model_bytes(model),
                           TOKENIZER_FILE: tokenizer.to_json().encode("utf-8"),
                           STATE_TENSORS_FILE: save_safetensors_bytes(tensors),
                           STATE_JSON_FILE: _json_bytes(state_json)})


def has_train_state(run_dir: str | Path) -> bool:
    run_dir = Path(run_dir)
    return (run_dir / STATE_JSON_FILE).is_file() and (run_dir / STATE_TENSORS_FILE).is_file()


def load_train_state(run_dir: str | Path) -> TrainState:
    run_dir = check_run_dir(run_dir)
    if not has_train_state(run_dir):
        raise CheckpointError(f"{run_dir} has no training state ({STATE_JSON_FILE}, "
                              f"{STATE_TENSORS_FILE}); it can be sampled but not resumed "
                              f"(use `train --init-from {run_dir}` to fine-tune it)")
    state_json = _read_json(run_dir / STATE_JSON_FILE)
    unknown = sorted(set(state_json) - set(STATE_KEYS))
    if unknown:
        raise CheckpointError(f"{run_dir / STATE_JSON_FILE}: unknown keys {unknown}")
    tensors = read_safetensors(run_dir / STATE_TENSORS_FILE)
    try:
        return _join_train_state(state_json, tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{run_dir / STATE_JSON_FILE}: malformed training state "
                              f"({error!r})") from None


def _split_train_state(state: TrainState) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Tensors (for safetensors) and the rest (for JSON)."""
    tensors: dict[str, Tensor] = {}
    optimizer_scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state.optimizer.get("state", {}).items():
        for name, value in param_state.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer.{param_id}.{name}"] = value.detach().cpu().contiguous()
            else:
                optimizer_scalars.setdefault(str(param_id), {})[name] = value
    rng_json = []
    for rank, rng in enumerate(state.rng):
        tensors[f"rng.{rank}.torch"] = rng["torch"].cpu()
        tensors[f"rng.{rank}.sampler"] = rng["sampler"].cpu()
        for device, cuda_state in enumerate(rng["cuda"]):
            tensors[f"rng.{rank}.cuda.{device}"] = cuda_state.cpu()
        rng_json.append({"python": rng["python"], "numpy": rng["numpy"],
                         "cuda_devices": len(rng["cuda"])})
    state_json = {"iteration": state.iteration, "best_val_loss": state.best_val_loss,
                  "optimizer": {"param_groups": state.optimizer.get("param_groups", []),
                                "scalars": optimizer_scalars},
                  "rng": rng_json, "scaler": state.scaler}
    return tensors, state_json


def _join_train_state(state_json: dict[str, Any], tensors: dict[str, Tensor]) -> TrainState:
    optimizer_state: dict[int, dict[str, Any]] = {}
    for param_id, values in state_json["optimizer"]["scalars"].items():
        optimizer_state.setdefault(int(param_id), {}).update(values)
    for key, tensor in tensors.items():
        if key.startswith("optimizer."):
            param_id, _, name = key.removeprefix("optimizer.").partition(".")
            optimizer_state.setdefault(int(param_id), {})[name] = tensor
    rng = []
    for rank, saved in enumerate(state_json["rng"]):
        cuda = [tensors[f"rng.{rank}.cuda.{d}"] for d in range(saved["cuda_devices"])]
        rng.append({"python": saved["python"], "numpy": saved["numpy"], "cuda": cuda,
                    "torch": tensors[f"rng.{rank}.torch"],
                    "sampler": tensors[f"rng.{rank}.sampler"]})
    # JSON turned tuples (AdamW's betas) into lists; give them back as torch made them.
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()}
              for group in state_json["optimizer"]["param_groups"]]
    optimizer = {"state": optimizer_state, "param_groups": groups}
    iteration = state_json["iteration"]
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"iteration must be an integer >= 0, got {iteration!r:.40}")
    return TrainState(iteration=iteration,
                      best_val_loss=float(state_json["best_val_loss"]),
                      optimizer=optimizer, rng=rng, scaler=state_json.get("scaler"))


# --- files ---------------------------------------------------------------------------------

def commit_files(run_dir: str | Path, files: dict[str, bytes]) -> None:
    """Replace several files of `run_dir` so that a crash leaves all old or all new ones."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        recover_interrupted_commit(run_dir)
        for name, data in files.items():
            with open(run_dir / (name + PENDING_SUFFIX), "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        fsync_dir(run_dir)
        # From here on the new checkpoint is the one: the journal is the commit point.
        write_text_atomic(run_dir / JOURNAL_FILE, json.dumps(sorted(files)))
    except OSError as error:  # a full disk, a read-only mount: nothing was committed
        _drop_pending(run_dir)
        raise CheckpointError(f"cannot save a checkpoint in {run_dir} ({error}); the previous "
                              f"checkpoint there is kept") from None
    _roll_forward(run_dir)


def _drop_pending(run_dir: Path) -> None:
    for pending in run_dir.glob("*" + PENDING_SUFFIX):
        with contextlib.suppress(OSError):
            pending.unlink()


def recover_interrupted_commit(run_dir: Path) -> None:
    """Finish a commit that a crash cut short, or drop pending files it never committed."""
    if (run_dir / JOURNAL_FILE).is_file():
        _roll_forward(run_dir)
        return
    for stale in run_dir.glob("*" + PENDING_SUFFIX):
        stale.unlink(missing_ok=True)


def _roll_forward(run_dir: Path) -> None:
    journal = run_dir / JOURNAL_FILE
    for name in _read_journal(journal):
        pending = run_dir / (name + PENDING_SUFFIX)
        if pending.exists():  # absent when renamed before a crash
            os.replace(pending, run_dir / name)
    fsync_dir(run_dir)
    journal.unlink()
    fsync_dir(run_dir)


def _read_journal(journal: Path) -> list[str]:
    try:
        names = json.loads(_read_small_text(journal))
    except ValueError as error:
        raise CheckpointError(f"{journal} is not valid JSON: {error}") from None
    if not isinstance(names, list) or not set(names) <= set(CHECKPOINT_FILES):
        raise CheckpointError(f"{journal} may only name the checkpoint files "
                              f"{list(CHECKPOINT_FILES)}, got {names!r:.200}")
    return names


def read_safetensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return load_safetensors_bytes(path.read_bytes())
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path} is not a valid safetensors file (truncated, or not "
                              f"safetensors; pickle/.pt files are never loaded): {error}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        data = json.loads(_read_small_text(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _read_small_text(path: Path) -> str:
    """A UTF-8 file of at most MAX_JSON_BYTES (checked before reading it)."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is {size:,} bytes, more than the {MAX_JSON_BYTES:,} a "
                              f"config, state or tokenizer file may hold")
    return path.read_bytes().decode("utf-8")


def _json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")


def _model_bytes(model: nn.Module) -> bytes:
    return save_safetensors_bytes(model_tensors(model), metadata={"format": "pt"})
