"""circuit-tracer's transcoders in glassgpt, and glassgpt's in circuit-tracer's files: one
entry for a directory of either kind (`load_circuit_tracer`), the conversion of glassgpt's
transcoders (`convert_to_circuit_tracer`), and its own MLP points read against a model.

    load_circuit_tracer("clt/")              -> CrossLayerTranscoder   (model_kind:
                                                cross_layer_transcoder)
    load_circuit_tracer("tc/", model)        -> [SAE, ...] one a layer (transcoder_set)
    convert_to_circuit_tracer(["tc/"], "ct/")   glassgpt's SAELens-format transcoders (or a
                                                CLT) -> circuit-tracer's directory

The files: glassgpt.interp.sae.circuit_tracer_set (a TranscoderSet, and what happens when the
layers' widths differ) and glassgpt.interp.sae.circuit_tracer_clt (a CLT).

circuit-tracer's published Llama and Qwen transcoders read "mlp.hook_in", the MLP's input after
the norm's gain, and write "mlp.hook_out". glassgpt reads the norm's x_hat (before the gain),
"blocks.L.ln2.hook_normalized": with the model's norm ln2 (gain g, shift b, b = 0 for an
RMSNorm), an encoder reading y = x_hat * g + b reads x_hat through
    W_enc' = g[:, None] * W_enc,  b_enc' = b_enc + b @ W_enc      (W_enc (d_model, d_tc))
the same pre-activations. "mlp.hook_out" is glassgpt's "blocks.L.hook_mlp_out" in a model
without a post-MLP norm; a model with one (Gemma's) is refused.

circuit-tracer's Gemma transcoders (Gemma Scope's params.npz) read "ln2.hook_normalized" and
write "hook_mlp_out" of TransformerLens's Gemma 2: the pre-MLP RMSNorm's x_hat, before its gain
1 + w, and the MLP's output after the post-MLP norm. glassgpt's Gemma block has both points
under the same names at the same places (the norms' x_hat; hook_mlp_out after ln2_post), so
they are read as they are. Against a model, a set's width and depth are checked to fit it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp.core.hooked import as_glass
from glassgpt.interp.sae import circuit_tracer_config as ctc
from glassgpt.interp.sae.circuit_tracer_clt import load_clt, save_clt
from glassgpt.interp.sae.circuit_tracer_set import (
    in_layer_order,
    load_transcoder_set,
    save_transcoder_set,
)
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.model import SAE

NORMALIZED = "ln2.hook_normalized"
Loaded = list[SAE] | CrossLayerTranscoder


def is_circuit_tracer_dir(path: str | Path) -> bool:
    """Whether `path` is a directory in circuit-tracer's layout (it holds config.yaml)."""
    return Path(path).is_dir() and (Path(path) / ctc.CONFIG_FILE).is_file()


def load_circuit_tracer(path: str | Path, model: nn.Module | None = None,
                        device: str | torch.device = "cpu", dtype: str = "float32") -> Loaded:
    """The transcoders of circuit-tracer's directory `path`: a CrossLayerTranscoder for
    model_kind cross_layer_transcoder, else glassgpt transcoders one a layer. With `model`,
    circuit-tracer's "mlp.hook_in"/"mlp.hook_out" become the model's points (see the module
    docstring); without one, such transcoders are refused."""
    kind = ctc.read_config(Path(path))["model_kind"]
    if kind == ctc.SET_KIND:
        loaded: Loaded = load_transcoder_set(path, dtype)
    else:
        from glassgpt.interp.sae.config import DTYPES
        loaded = load_clt(path, DTYPES[dtype])
    if reads_mlp_points(loaded):
        if model is None:
            raise CheckpointError(f"{path} reads circuit-tracer's mlp.hook_in / mlp.hook_out, "
                                  f"which are read against the model they replace MLPs of")
        with torch.no_grad():
            loaded = onto_model_points(loaded, model)
    if isinstance(loaded, CrossLayerTranscoder):
        return loaded.to(device)
    if model is not None:
        check_fits(loaded, model, path)
    return [sae.to(device) for sae in loaded]


def check_fits(saes: list[SAE], model: nn.Module, path: str | Path) -> None:
    """One transcoder a layer of `model` at most, each reading and writing its width."""
    config = as_glass(model).config
    if len(saes) > config.n_layer:
        raise InputError(f"{path} holds transcoders for {len(saes)} layers; the model has "
                         f"{config.n_layer}")
    if saes[0].cfg.d_in != config.n_embd:
        raise InputError(f"{path}'s transcoders read d_model {saes[0].cfg.d_in}; the model's "
                         f"d_model is {config.n_embd}")


def reads_mlp_points(loaded: Loaded) -> bool:
    if isinstance(loaded, CrossLayerTranscoder):
        hooks = [loaded.input_hook, loaded.output_hook]
    else:
        hooks = [name for sae in loaded for name in (sae.cfg.hook_name, sae.cfg.hook_name_out)]
    return any(h.endswith((ctc.MLP_IN, ctc.MLP_OUT)) for h in hooks)


def onto_model_points(loaded: Loaded, model: nn.Module) -> Loaded:
    """Transcoders reading "mlp.hook_in" and writing "mlp.hook_out", rewritten to read the
    model's ln2.hook_normalized and write its hook_mlp_out (the same numbers)."""
    glass = as_glass(model)
    if isinstance(loaded, CrossLayerTranscoder):
        if loaded.n_layers != len(glass.blocks):
            raise InputError(f"the CLT spans {loaded.n_layers} layers, the model has "
                             f"{len(glass.blocks)}")
        if loaded.input_hook.endswith(ctc.MLP_IN):
            for layer in range(loaded.n_layers):
                fold_norm(loaded.W_enc[layer], loaded.b_enc[layer], mlp_norm(glass, layer))
            loaded.input_hook = ctc.BLOCK + NORMALIZED
        if loaded.output_hook.endswith(ctc.MLP_OUT):
            loaded.output_hook = check_mlp_out(glass, 0)
        return loaded
    for layer, sae in enumerate(loaded):
        if sae.cfg.hook_name.endswith(ctc.MLP_IN):
            fold_norm(sae.W_enc, sae.b_enc, mlp_norm(glass, layer))
            sae.cfg.metadata.hook_name = f"blocks.{layer}.{NORMALIZED}"
        if sae.cfg.hook_name_out.endswith(ctc.MLP_OUT):
            sae.cfg.metadata.hook_name_out = check_mlp_out(glass, layer).replace("{L}",
                                                                                str(layer))
    return loaded


def mlp_norm(glass: nn.Module, layer: int) -> tuple[Tensor, Tensor | None]:
    """(gain, shift) of the norm before layer `layer`'s MLP: y = x_hat * gain + shift."""
    if layer >= len(glass.blocks):
        raise InputError(f"transcoders for {layer + 1}+ layers, the model has "
                         f"{len(glass.blocks)}")
    block = glass.blocks[layer]
    if not glass.config.pre_ln or getattr(block, "ln2", None) is None:
        raise InputError("circuit-tracer's mlp.hook_in is the output of a norm before the "
                         "MLP; this model has none there (post-LN or attention-only)")
    norm = block.ln2
    gain = norm.gain if hasattr(norm, "gain") else norm.weight
    return gain.detach(), getattr(norm, "bias", None)


def fold_norm(W_enc: Tensor, b_enc: Tensor, norm: tuple[Tensor, Tensor | None]) -> None:
    """In place: the encoder W_enc (d_model, d_tc), b_enc (d_tc,) reading x_hat instead of
    x_hat * gain + shift."""
    gain, shift = norm
    if shift is not None:
        b_enc.add_(shift.detach().to(W_enc.dtype) @ W_enc)
    W_enc.mul_(gain.to(W_enc.dtype)[:, None])


def check_mlp_out(glass: nn.Module, layer: int) -> str:
    if getattr(glass.blocks[layer], "ln2_post", None) is not None:
        raise InputError("circuit-tracer's mlp.hook_out is the MLP's output before this "
                         "model's post-MLP norm; glassgpt's graph replaces hook_mlp_out, after "
                         "it: these transcoders do not fit it")
    return ctc.BLOCK + "hook_mlp_out"


# --- glassgpt's transcoders -> circuit-tracer's directory ------------------------------------

@dataclass(frozen=True)
class Converted:
    """What `convert_to_circuit_tracer` wrote: the directory, its model_kind, the number of
    layers and each layer's width before padding (its d_transcoder is the largest)."""

    path: Path
    kind: str
    n_layers: int
    widths: tuple[int, ...]

    @property
    def padded_layers(self) -> list[int]:
        return [layer for layer, width in enumerate(self.widths) if width < max(self.widths)]


def convert_to_circuit_tracer(sources: Sequence[str | Path], out: str | Path,
                              overwrite: bool = False, pad: bool = True) -> Converted:
    """glassgpt's transcoders in `sources` (SAELens-format directories, one a layer, or one
    directory holding them; or one CLT directory) written as circuit-tracer's directory `out`.
    Layers narrower than the widest are padded with dead latents (`pad=False`: refused)."""
    if len(sources) == 1 and is_circuit_tracer_dir(sources[0]):
        loaded = load_circuit_tracer(sources[0])
        if isinstance(loaded, CrossLayerTranscoder):
            path = save_clt(loaded, out, overwrite)
            return Converted(path, ctc.CLT_KIND, loaded.n_layers,
                             (loaded.d_transcoder,) * loaded.n_layers)
        saes = loaded
    else:
        saes = saelens_transcoders(sources)
    path = save_transcoder_set(saes, out, overwrite, pad)
    widths = tuple(sae.cfg.d_sae for sae in in_layer_order(saes))
    return Converted(path, ctc.SET_KIND, len(widths), widths)


def saelens_transcoders(sources: Sequence[str | Path]) -> list[SAE]:
    """Each source a dictionary's directory (cfg.json), or a directory of such directories."""
    found: list[SAE] = []
    for source in sources:
        source = Path(source)
        if (source / "cfg.json").is_file() or not source.is_dir():
            found.append(SAE.load(source))
            continue
        inner = sorted(p for p in source.iterdir() if (p / "cfg.json").is_file())
        if not inner:
            raise CheckpointError(f"{source} holds no transcoder (cfg.json) and is not "
                                  f"circuit-tracer's directory (config.yaml)")
        found.extend(SAE.load(p) for p in inner)
    return found
