"""TransformerLens's checkpoint as files: a state dict read from safetensors or a .pth of tensors
(`torch.load(weights_only=True)`: no object is unpickled), a checkpoint loaded from its config
and its state, and a glass model written as a directory TransformerLens loads
(config.json and model.safetensors, marked as glassgpt's).

    model = load_lens_checkpoint("config.json", "attn_only_2L_half.pth")
    write_lens_checkpoint(model, "out/")
    export_lens_run("runs/x", "out/")  # `glassgpt convert RUN --to-lens OUT`
    export_lens_run("runs/x", "out/", circuit_tracer=True)  # `... --circuit-tracer`

circuit-tracer 0.5 builds its TransformerLens replacement model from a config
(`ReplacementModel.from_config(cfg, transcoders)`: the way for a model TransformerLens does not
name), and that model has wrapped each MLP and the unembedding before any weight is loaded: its
state dict holds blocks.{l}.mlp.old_mlp.W_in, ... and unembed.old_unembed.W_U, b_U where
HookedTransformer holds blocks.{l}.mlp.W_in and unembed.W_U. With `circuit_tracer`, the export
writes those names too, as circuit_tracer.safetensors (the same tensors again), so that
`model.load_state_dict(load_file(".../circuit_tracer.safetensors"), strict=False)` leaves
nothing out but the transcoders (docs/interpretability.md's recipe).

The tensors are glassgpt.formats.transformer_lens's, the config
glassgpt.formats.transformer_lens_config's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from glassgpt.errors import CheckpointError
from glassgpt.formats.transformer_lens import lens_state_dict, model_from_lens_checkpoint
from glassgpt.formats.transformer_lens_config import lens_config_dict
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import describe_weights, load_model
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.tensorfile import SafetensorsFile

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
CIRCUIT_TRACER_NAME = "circuit_tracer.safetensors"  # the state in circuit-tracer's names
WRITTEN_BY = {"written_by": "glassgpt convert --to-lens"}  # the safetensors metadata: our mark
PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")  # read with torch.load(weights_only=True)


def read_lens_state(path: str | Path) -> dict[str, Tensor]:
    """A state dict from a file: safetensors, or a .pth / .pt of tensors read with
    torch.load(weights_only=True); a pickle holding anything else is refused."""
    path = Path(path).expanduser()
    if path.suffix == ".safetensors":
        with SafetensorsFile(path, CheckpointError) as file:
            return file.read_all()
    if path.suffix not in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: a TransformerLens state dict is read from .safetensors "
                              f"or {', '.join(PICKLE_SUFFIXES)} (torch.save of tensors)")
    with open(files.open_regular_file(path, CheckpointError), "rb") as file:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 (the weights-only unpickler raises what
            # a damaged file makes it: UnpicklingError, EOFError, KeyError, IndexError, ...)
            reason = (str(error).strip() or "empty").splitlines()[0][:160]
            raise CheckpointError(f"{path} is not a file of tensors torch.load can read with "
                                  f"weights_only=True (no object is unpickled): {reason}"
                                  ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of "
                              f"named tensors")
    return state


def load_lens_checkpoint(cfg: dict[str, Any] | str | Path,
                         state: dict[str, Tensor] | str | Path) -> GPT:
    """`model_from_lens_checkpoint` of a config (a dict, a HookedTransformerConfig or a
    config.json) and a state dict (or its file)."""
    if isinstance(cfg, str | Path):
        cfg = files.read_json_object(Path(cfg).expanduser(), CheckpointError)
    elif not isinstance(cfg, dict) and callable(getattr(cfg, "to_dict", None)):
        cfg = dict(cfg.to_dict())  # a HookedTransformerConfig
    if isinstance(state, str | Path):
        state = read_lens_state(state)
    return model_from_lens_checkpoint(cfg, state)


def replacement_model_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HookedTransformer's state under the names circuit-tracer 0.5's TransformerLens
    replacement model gives it: each block's MLP tensors under mlp.old_mlp, the unembedding's
    under unembed.old_unembed (its ReplacementMLP and ReplacementUnembed keep the originals
    there); every other name as it is."""
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("blocks.") and ".mlp." in name:
            name = name.replace(".mlp.", ".mlp.old_mlp.", 1)
        elif name.startswith("unembed."):
            name = "unembed.old_unembed." + name.removeprefix("unembed.")
        renamed[name] = tensor
    return renamed


def is_lens_export(out: Path) -> bool:
    """Whether `out` holds an earlier `--to-lens` export: its two files (three with
    circuit-tracer's) and our mark on each weights file."""
    names = {p.name for p in out.iterdir()}
    if names not in ({CONFIG_NAME, WEIGHTS_NAME}, {CONFIG_NAME, WEIGHTS_NAME, CIRCUIT_TRACER_NAME}):
        return False
    return all(_marked(out / name) for name in names - {CONFIG_NAME})


def _marked(path: Path) -> bool:
    if files.entry_kind(path) != "file":
        return False
    try:
        with safe_open(path, framework="pt") as file:
            return (file.metadata() or {}).get("written_by") == WRITTEN_BY["written_by"]
    except Exception:  # noqa: BLE001 (safetensors raises its own errors for a damaged file)
        return False


def write_lens_checkpoint(model: GPT, out: str | Path, force: bool = False,
                          circuit_tracer: bool = False) -> Path:
    """OUT/config.json (lens_config_dict) and OUT/model.safetensors (lens_state_dict), and with
    `circuit_tracer` OUT/circuit_tracer.safetensors (replacement_model_state), the directory
    whole or not at all. An existing non-empty `out` is replaced only with `force`, and only
    when it is an earlier export of this kind."""
    out = files.check_can_make_dir(Path(out).expanduser(), CheckpointError)
    cfg, state = lens_config_dict(model), lens_state_dict(model)  # refusals before writing
    replacing = out.exists() and any(out.iterdir())
    if replacing and not force:
        raise CheckpointError(f"{out} already exists and is not an empty directory; choose a "
                              f"new one, or replace an earlier --to-lens export with --force")
    if replacing and not is_lens_export(out):
        raise CheckpointError(f"{out} does not hold a TransformerLens export glassgpt wrote "
                              f"(only {CONFIG_NAME} and a marked {WEIGHTS_NAME}); it is not "
                              f"replaced")
    with staged_directory(out, replacing) as staging:
        (staging / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        state = {name: t.cpu() for name, t in state.items()}
        save_file(state, staging / WEIGHTS_NAME, metadata=WRITTEN_BY)
        if circuit_tracer:
            save_file(replacement_model_state(state), staging / CIRCUIT_TRACER_NAME,
                      metadata=WRITTEN_BY)
    return out


@dataclasses.dataclass(frozen=True)
class LensExport:
    """What `export_lens_run` wrote: the directory, and which weights (in words)."""

    out: Path
    weights: str


def export_lens_run(run_dir: str | Path, out: str | Path, checkpoint: str = "best",
                    force: bool = False, circuit_tracer: bool = False) -> LensExport:
    """`glassgpt convert RUN --to-lens OUT [--circuit-tracer]`: the run's `checkpoint` weights,
    written by `write_lens_checkpoint`; `out` must be outside the run."""
    # the one overlap check of every export; imported here, as HookedGPT imports this module
    # and needs none of the Hugging Face side convert brings
    from glassgpt.formats.convert import check_apart

    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    files.check_can_make_dir(out, CheckpointError)
    check_apart(out, run_dir, f"{run_dir}, the run being exported")
    model, _ = load_model(run_dir, checkpoint=checkpoint)
    return LensExport(write_lens_checkpoint(model, out, force, circuit_tracer),
                      describe_weights(run_dir, checkpoint))
