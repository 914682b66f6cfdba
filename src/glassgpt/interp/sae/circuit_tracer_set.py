"""Per-layer transcoders in circuit-tracer 0.5's files, both ways: a `TranscoderSet` directory
(its `to_safetensors` and its cache's `load_transcoder_set`), read into and written from
glassgpt's SAELens-format transcoders (`SAE`, architecture "transcoder" or
"jumprelu_transcoder").

    layer_{i}.safetensors   W_enc (d_tc, d_model), W_dec (d_tc, d_model), b_enc (d_tc,),
                            b_dec (d_model,), and activation_function.threshold (d_tc,) for a
                            JumpReLU one (circuit-tracer's load_relu_transcoder reads these);
                            or Gemma Scope's params.npz (glassgpt.interp.sae.circuit_tracer_npz)
    config.yaml             model_kind: transcoder_set, the hooks (and, from a hub config,
                            `transcoders:` the files in layer order: hub URIs found in the
                            directory at their path in the repository, see `listed_path`)

SAELens's W_enc is (d_in, d_sae), circuit-tracer's the transpose. Activations: circuit-tracer's
JumpReLU passes z * [z > theta], glassgpt's ReLU(z) * [z > theta]; they agree for theta >= 0.
So a glassgpt threshold is written as max(theta, 0) (the same function: below 0 a ReLU already
zeroes), and a circuit-tracer threshold below 0 (negative activations) is refused on reading.

One width: circuit-tracer's TranscoderSet holds one d_transcoder for every layer. A narrower
layer is padded with dead latents (zero encoder and decoder rows, b_enc -1, threshold 0: never
active, so encode and decode are unchanged), and config.yaml's glassgpt section records each
layer's own width, so that glassgpt reads the padding back off. `pad=False` refuses instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from glassgpt.errors import CheckpointError
from glassgpt.hooknames import parse_hook_name
from glassgpt.interp.sae import circuit_tracer_config as ctc
from glassgpt.interp.sae.circuit_tracer_npz import read_gemma_scope_npz
from glassgpt.interp.sae.config import SAEConfig
from glassgpt.interp.sae.model import SAE
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite, check_float_dtypes

THRESHOLD = "activation_function.threshold"
HUB = "hf://"
PAD_BIAS = -1.0  # a padded latent's pre-activation: below every threshold, below ReLU's 0
# what cfg.json's metadata of a glassgpt transcoder carries over into config.yaml (provenance)
KEPT_METADATA = ("model_name", "glassgpt_run", "glassgpt_weights_sha256")


def save_transcoder_set(saes: Sequence[SAE], path: str | Path, overwrite: bool = False,
                        pad: bool = True, extra: dict[str, Any] | None = None) -> Path:
    """Write glassgpt's transcoders, one a layer from 0 (any order given), as circuit-tracer's
    TranscoderSet directory at `path` (see the module docstring), whole or not at all."""
    ordered = in_layer_order(saes)
    width = max(sae.cfg.d_sae for sae in ordered)
    narrower = [layer for layer, sae in enumerate(ordered) if sae.cfg.d_sae < width]
    if narrower and not pad:
        raise CheckpointError(f"circuit-tracer's TranscoderSet holds one width; layers "
                              f"{narrower} have fewer than {width} latents (pad them with dead "
                              f"latents, or train them {width} wide)")
    first = ordered[0].cfg
    input_hook = ctc.layer_template(first.hook_name, 0, "input hook")
    output_hook = ctc.layer_template(first.hook_name_out, 0, "output hook")
    own = {"input_hook": input_hook, "output_hook": output_hook,
           "widths": [sae.cfg.d_sae for sae in ordered],
           "metadata": {k: first.metadata[k] for k in KEPT_METADATA if first.metadata.get(k)}}
    text = ctc.config_text(ctc.SET_KIND, ctc.ct_hook(input_hook, "input hook"),
                           ctc.ct_hook(output_hook, "output hook"), own, extra)
    out = files.check_can_make_dir(files.check_path_given(path, CheckpointError, "path"),
                                   CheckpointError)
    replacing = out.exists() and any(out.iterdir())
    if replacing:
        ctc.check_replaceable(out, overwrite, is_layer_file, "transcoder set")
    with staged_directory(out, replacing) as staging:
        for layer, sae in enumerate(ordered):
            tensors = padded(ct_tensors(sae), width)
            check_finite(tensors, f"the transcoder of layer {layer}", CheckpointError)
            files.write_bytes_atomic(staging / f"layer_{layer}.safetensors",
                                     safetensors_bytes(tensors))
        files.write_text_atomic(staging / ctc.CONFIG_FILE, text)
    return out


def in_layer_order(saes: Sequence[SAE]) -> list[SAE]:
    """The transcoders by the layer they write, refused unless one a layer 0..n-1, each reading
    and writing the same point of its block as the others, d_in = d_out."""
    by_layer: dict[int, SAE] = {}
    for sae in saes:
        if not isinstance(sae, SAE) or not sae.cfg.is_transcoder:
            kind = sae.cfg.architecture if isinstance(sae, SAE) else type(sae).__name__
            raise CheckpointError(f"circuit-tracer's TranscoderSet holds transcoders; got a "
                                  f"{kind} dictionary")
        layer = parse_hook_name(sae.cfg.hook_name_out or "").layer
        if layer is None or layer in by_layer:
            raise CheckpointError(f"the transcoder writing {sae.cfg.hook_name_out!r:.60} is not "
                                  f"the only one of a block's point")
        if sae.cfg.d_in != sae.cfg.d_out:
            raise CheckpointError(f"circuit-tracer's transcoders read and write d_model; the one "
                                  f"of layer {layer} reads {sae.cfg.d_in}, writes {sae.cfg.d_out}")
        by_layer[layer] = sae
    if not by_layer or sorted(by_layer) != list(range(len(by_layer))):
        raise CheckpointError(f"circuit-tracer's TranscoderSet needs one transcoder a layer "
                              f"from 0; got layers {sorted(by_layer)}")
    ordered = [by_layer[layer] for layer in range(len(by_layer))]
    for layer, sae in enumerate(ordered):
        for name, what in ((sae.cfg.hook_name, "input hook"),
                           (sae.cfg.hook_name_out, "output hook")):
            first = getattr(ordered[0].cfg, "hook_name" if what == "input hook" else
                            "hook_name_out")
            if ctc.layer_template(name, layer, what) != ctc.layer_template(first, 0, what):
                raise CheckpointError(f"circuit-tracer's TranscoderSet has one {what} for "
                                      f"every layer; layer {layer}'s is {name}, layer 0's "
                                      f"{first}")
    return ordered


def ct_tensors(sae: SAE) -> dict[str, Tensor]:
    """One glassgpt transcoder as circuit-tracer's layer file holds it (CPU, contiguous)."""
    tensors = {"W_enc": sae.W_enc.T, "W_dec": sae.W_dec, "b_enc": sae.b_enc, "b_dec": sae.b_dec}
    if sae.threshold is not None:  # z [z > max(theta, 0)] = ReLU(z) [z > theta]
        tensors[THRESHOLD] = sae.threshold.clamp(min=0)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def padded(tensors: dict[str, Tensor], width: int) -> dict[str, Tensor]:
    """A layer's tensors with dead latents added up to `width` (see the module docstring)."""
    extra = width - tensors["b_enc"].shape[0]
    if extra == 0:
        return tensors
    fill = {"W_enc": 0.0, "W_dec": 0.0, "b_enc": PAD_BIAS, THRESHOLD: 0.0}
    out = dict(tensors)
    for name, value in fill.items():
        if name in tensors:
            t = tensors[name]
            out[name] = torch.cat([t, t.new_full((extra, *t.shape[1:]), value)]).contiguous()
    return out


# --- reading ---------------------------------------------------------------------------------

def load_transcoder_set(path: str | Path, dtype: str = "float32") -> list[SAE]:
    """circuit-tracer's TranscoderSet directory at `path` (its cache's layout, or a hub
    repository's files downloaded beside their config.yaml) as glassgpt transcoders, one a
    layer; hooks "mlp.hook_in"/"mlp.hook_out" are left for glassgpt.interp.sae.circuit_tracer
    to read against a model."""
    directory = files.check_path_given(path, CheckpointError, "path")
    config = ctc.read_config(directory)
    if config["model_kind"] != ctc.SET_KIND:
        raise CheckpointError(f"{directory} holds a {config['model_kind']}, not a "
                              f"{ctc.SET_KIND}")
    own = config["glassgpt"]
    source = directory / ctc.CONFIG_FILE
    input_hook = own.get("input_hook") or ctc.glass_hook(config["feature_input_hook"], source,
                                                        "feature_input_hook")
    output_hook = own.get("output_hook") or ctc.glass_hook(config["feature_output_hook"],
                                                          source, "feature_output_hook")
    paths = layer_paths(directory, config)
    widths = own.get("widths") or [None] * len(paths)
    if not isinstance(widths, list) or len(widths) != len(paths):
        raise CheckpointError(f"{source}: glassgpt.widths must list one width a layer")
    metadata = own.get("metadata") or {}
    return [read_layer(p, layer, input_hook, output_hook, widths[layer], metadata, dtype)
            for layer, p in enumerate(paths)]


def layer_paths(directory: Path, config: dict[str, Any]) -> list[Path]:
    """The layer files in layer order: config.yaml's `transcoders` (hub URIs and relative
    paths found in `directory` by name), else layer_0.safetensors, layer_1, ..."""
    listed = config.get("transcoders")
    if listed is None:
        n = ctc.indexed_files(directory, "layer")
        if n == 0:
            raise CheckpointError(f"{directory} holds no layer_i.safetensors")
        return [directory / f"layer_{i}.safetensors" for i in range(n)]
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise CheckpointError(f"{directory / ctc.CONFIG_FILE}: transcoders must list files")
    names = [entry.split("?")[0].rsplit("/", 1)[-1] for entry in listed]
    return [listed_path(directory, entry, names.count(name) == 1)
            for entry, name in zip(listed, names, strict=True)]


def listed_path(directory: Path, entry: str, name_is_unique: bool) -> Path:
    """One `transcoders:` entry's file inside `directory`: a hub URI "hf://owner/repo/PATH" at
    PATH or owner/repo/PATH (where `huggingface-cli download [--local-dir]` puts it), a relative
    path as written, or (the name naming one entry only) by its file name beside config.yaml."""
    where = entry.split("?")[0]
    candidates = [where]
    if where.startswith(HUB):
        repo_and_path = where[len(HUB):]
        parts = repo_and_path.split("/", 2)
        candidates = [parts[2], repo_and_path] if len(parts) == 3 else []
    if name_is_unique:
        candidates.append(where.rsplit("/", 1)[-1])
    for relative in candidates:
        parts = PurePosixPath(relative).parts
        local = directory / relative  # never above it (a link inside it, the user's, is read)
        if parts and parts[0] != "/" and ".." not in parts and local.is_file():
            return local
    raise CheckpointError(f"{entry} is not in {directory}: download the transcoders into it "
                          f"(a hub file at its path in the repository, e.g. "
                          f"`huggingface-cli download REPO FILES --local-dir {directory}`; "
                          f"circuit-tracer's save_transcoders_to_cache writes such a directory)")


def read_layer(path: Path, layer: int, input_hook: str, output_hook: str, width: Any,
               metadata: dict[str, Any], dtype: str) -> SAE:
    """One circuit-tracer layer file as a glassgpt transcoder (its padding read off)."""
    tensors = read_ct_tensors(path, dtype)
    d_tc, d_model = tensors["W_enc"].shape
    if width is not None:
        if isinstance(width, bool) or not isinstance(width, int) or not 0 < width <= d_tc:
            raise CheckpointError(f"{path}: glassgpt's width {width!r:.20} is not in 1..{d_tc}")
        tensors = {k: v[:width] if k != "b_dec" else v for k, v in tensors.items()}
        d_tc = width
    jump = THRESHOLD in tensors
    if jump and bool((tensors[THRESHOLD] < 0).any()):
        raise CheckpointError(f"{path}: thresholds down to {float(tensors[THRESHOLD].min()):.4g}"
                              f"; circuit-tracer passes negative activations above a negative "
                              f"threshold, which glassgpt's JumpReLU (ReLU first) cannot")
    cfg = SAEConfig(d_in=d_model, d_sae=d_tc, d_out=d_model, apply_b_dec_to_input=False,
                    architecture="jumprelu_transcoder" if jump else "transcoder", dtype=dtype,
                    metadata={**metadata, "hook_name": input_hook.replace("{L}", str(layer)),
                              "hook_name_out": output_hook.replace("{L}", str(layer))})
    sae = SAE(cfg)
    with torch.no_grad():
        sae.W_enc.copy_(tensors["W_enc"].T)
        for name in ("W_dec", "b_enc", "b_dec"):
            getattr(sae, name).copy_(tensors[name])
        if jump:
            sae.threshold.copy_(tensors[THRESHOLD])
    return sae


def read_ct_tensors(path: Path, dtype: str) -> dict[str, Tensor]:
    """A circuit-tracer layer file's tensors, names and shapes checked before reading."""
    from glassgpt.interp.sae.config import DTYPES

    if path.suffix == ".npz":  # Gemma Scope's, as circuit-tracer's "gemma-scope" loader reads
        tensors = read_gemma_scope_npz(path, DTYPES[dtype])
        tensors[THRESHOLD] = tensors.pop("threshold")
        check_finite(tensors, path, CheckpointError)
        return tensors
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: glassgpt reads circuit-tracer's .safetensors layer files "
                              f"and Gemma Scope's params.npz")
    with SafetensorsFile(path, CheckpointError) as file:
        found = {name: info.shape for name, info in file.header.items()}
        needed = {"W_enc", "W_dec", "b_enc", "b_dec"}
        if not needed <= set(found) or set(found) - needed - {THRESHOLD}:
            raise CheckpointError(f"{path} holds {sorted(found)}; glassgpt reads W_enc, W_dec, "
                                  f"b_enc, b_dec and {THRESHOLD} (no W_skip)")
        if len(found["W_enc"]) != 2 or 0 in found["W_enc"]:
            raise CheckpointError(f"{path}: W_enc has shape {found['W_enc']}, not (d_tc, "
                                  f"d_model)")
        d_tc, d_model = found["W_enc"]
        expected = {"W_enc": (d_tc, d_model), "W_dec": (d_tc, d_model), "b_enc": (d_tc,),
                    "b_dec": (d_model,), THRESHOLD: (d_tc,)}
        for name, shape in found.items():
            if shape != expected[name]:
                raise CheckpointError(f"{path}: {name} has shape {shape}, W_enc's "
                                      f"{found['W_enc']} makes it {expected[name]}")
        check_float_dtypes(file.header, path, CheckpointError)
        tensors = {name: file.read(name, DTYPES[dtype]) for name in found}
    check_finite(tensors, path, CheckpointError)
    return tensors


def is_layer_file(name: str) -> bool:
    return name.startswith("layer_") and name.endswith(".safetensors")

