"""A cross-layer transcoder in circuit-tracer 0.5's files, both ways (its
`CrossLayerTranscoder.to_safetensors` and `load_clt`), which are glassgpt's own files of a CLT:

    W_enc_{i}.safetensors   W_enc_{i} (d_tc, d_model), b_enc_{i} (d_tc,), b_dec_{i} (d_model,),
                            threshold_{i} (d_tc,) for a JumpReLU CLT
    W_dec_{i}.safetensors   W_dec_{i} (d_tc, n_layers - i, d_model)
    config.yaml             model_kind: cross_layer_transcoder, its hooks, and glassgpt's own
                            section (glassgpt.interp.sae.circuit_tracer_config)

glassgpt's CrossLayerTranscoder keeps W_enc as (n_layers, d_model, d_tc), the transpose of
circuit-tracer's per-layer (d_tc, d_model). Reading checks every file's header (names, shapes,
float dtypes) before any tensor is read, and the tensors' values are finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.interp.sae import circuit_tracer_config as ctc
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite, check_float_dtypes


def clt_files(n_layers: int) -> set[str]:
    names = {ctc.CONFIG_FILE}
    for i in range(n_layers):
        names |= {f"W_enc_{i}.safetensors", f"W_dec_{i}.safetensors"}
    return names


def save_clt(clt: CrossLayerTranscoder, path: str | Path, overwrite: bool = False,
             extra: dict[str, Any] | None = None) -> Path:
    """Write `clt` to the directory `path` in circuit-tracer's layout (see the module
    docstring), whole or not at all. An existing directory is replaced only with `overwrite`
    and only when glassgpt wrote it (a CLT's files and nothing else, its config.yaml with
    glassgpt's section). `extra`: more config.yaml keys
    (circuit-tracer's `scan`, ...)."""
    out = files.check_can_make_dir(files.check_path_given(path, CheckpointError, "path"),
                                   CheckpointError)
    replacing = out.exists() and any(out.iterdir())
    if replacing:
        n_there = len(list(out.glob("W_enc_*.safetensors")))
        ctc.check_replaceable(out, overwrite, clt_files(n_there).__contains__, "CLT")
    contents = clt_file_bytes(clt, extra)
    with staged_directory(out, replacing) as staging:
        for name, data in contents.items():
            files.write_bytes_atomic(staging / name, data)
    return out


def clt_file_bytes(clt: CrossLayerTranscoder, extra: dict[str, Any] | None = None
                   ) -> dict[str, bytes]:
    """Every file of `clt`'s directory (file name -> its bytes), checked finite: what
    `save_clt` writes, and the trainer beside its own state."""
    kind = ctc.TOPK_CLT_KIND if clt.activation == "topk" else ctc.CLT_KIND
    text = ctc.config_text(kind, ctc.ct_hook(clt.input_hook, "input hook"),
                           ctc.ct_hook(clt.output_hook, "output hook"), own_section(clt), extra)
    contents = {}
    for i, (encoder, decoder) in enumerate(layer_tensors(clt)):
        check_finite({**encoder, **decoder}, "the CLT being saved", CheckpointError)
        contents[f"W_enc_{i}.safetensors"] = safetensors_bytes(encoder)
        contents[f"W_dec_{i}.safetensors"] = safetensors_bytes(decoder)
    contents[ctc.CONFIG_FILE] = text.encode("utf-8")
    return contents


def own_section(clt: CrossLayerTranscoder) -> dict[str, Any]:
    section: dict[str, Any] = {"activation": clt.activation, "input_hook": clt.input_hook,
                               "output_hook": clt.output_hook}
    if clt.k is not None:
        section["k"] = clt.k
    if clt.metadata:
        section["metadata"] = dict(clt.metadata)
    return section


def layer_tensors(clt: CrossLayerTranscoder):
    """(encoder file's tensors, decoder file's tensors) of each layer, in circuit-tracer's
    names and shapes, on the CPU."""
    for i in range(clt.n_layers):
        encoder = {f"W_enc_{i}": clt.W_enc[i].T,  # (d_tc, d_model)
                   f"b_enc_{i}": clt.b_enc[i], f"b_dec_{i}": clt.b_dec[i]}
        if clt.threshold is not None:
            encoder[f"threshold_{i}"] = clt.threshold[i]
        decoder = {f"W_dec_{i}": clt.W_dec[i]}  # (d_tc, n_layers - i, d_model)
        yield ({k: v.detach().cpu().contiguous() for k, v in encoder.items()},
               {k: v.detach().cpu().contiguous() for k, v in decoder.items()})


def load_clt(path: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> CrossLayerTranscoder:
    """The CLT in the directory `path` (circuit-tracer's layout, written by it or by glassgpt),
    every file checked before anything is built. Its hooks are config.yaml's (glassgpt's own
    section first); circuit-tracer's "mlp.hook_in"/"mlp.hook_out" are kept as they are, for
    glassgpt.interp.sae.circuit_tracer to read against a model."""
    directory = files.check_path_given(path, CheckpointError, "path")
    config = ctc.read_config(directory)
    n_layers = ctc.indexed_files(directory, "W_enc")
    if n_layers == 0 or ctc.indexed_files(directory, "W_dec") != n_layers:
        raise CheckpointError(f"{directory} needs W_enc_i.safetensors and W_dec_i.safetensors "
                              f"for each layer i (a CLT in circuit-tracer's layout)")
    encoders = [read_encoder(directory, i, dtype) for i in range(n_layers)]
    d_tc, d_model = encoders[0]["W_enc_0"].shape
    jump = "threshold_0" in encoders[0]
    clt = build(config, directory, n_layers, d_model, d_tc, jump, dtype)
    with torch.no_grad():
        for i, encoder in enumerate(encoders):
            check_layer(encoder, i, (d_tc, d_model), jump, directory)
            clt.W_enc[i].copy_(encoder[f"W_enc_{i}"].T)
            clt.b_enc[i].copy_(encoder[f"b_enc_{i}"])
            clt.b_dec[i].copy_(encoder[f"b_dec_{i}"])
            if jump:
                clt.threshold[i].copy_(encoder[f"threshold_{i}"])
            clt.W_dec[i].copy_(read_decoder(directory, i, (d_tc, n_layers - i, d_model), dtype))
    return clt.to(device)


def build(config: dict[str, Any], directory: Path, n_layers: int, d_model: int, d_tc: int,
          jump: bool, dtype: torch.dtype) -> CrossLayerTranscoder:
    """The empty CLT config.yaml and the first encoder describe."""
    own = config["glassgpt"]
    topk = config["model_kind"] == ctc.TOPK_CLT_KIND
    activation = "topk" if topk else "jumprelu" if jump else "relu"
    if own.get("activation", activation) != activation:
        raise CheckpointError(f"{directory}: config.yaml says activation "
                              f"{own.get('activation')!r:.40}, its tensors make it {activation}")
    source = directory / ctc.CONFIG_FILE
    hooks = (own.get("input_hook") or
             ctc.glass_hook(config["feature_input_hook"], source, "feature_input_hook"),
             own.get("output_hook") or
             ctc.glass_hook(config["feature_output_hook"], source, "feature_output_hook"))
    metadata = own.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{source}: glassgpt.metadata must be a mapping")
    try:
        return CrossLayerTranscoder(n_layers, d_model, d_tc, activation, own.get("k"), *hooks,
                                    dtype=dtype, metadata=metadata)
    except ConfigError as error:
        raise CheckpointError(f"{source}: {error}") from None


def read_encoder(directory: Path, i: int, dtype: torch.dtype) -> dict[str, Tensor]:
    path = directory / f"W_enc_{i}.safetensors"
    names = {f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}"}
    with SafetensorsFile(path, CheckpointError) as file:
        found = set(file.header)
        if not names <= found or found - names - {f"threshold_{i}"}:
            raise CheckpointError(f"{path} holds {sorted(found)}; circuit-tracer's CLT layer "
                                  f"holds {sorted(names)} and threshold_{i} for a JumpReLU "
                                  f"(W_skip is not read)")
        check_float_dtypes(file.header, path, CheckpointError)
        if len(file.header[f"W_enc_{i}"].shape) != 2:
            raise CheckpointError(f"{path}: W_enc_{i} is not (d_tc, d_model)")
        tensors = {name: file.read(name, dtype) for name in found}
    check_finite(tensors, path, CheckpointError)
    return tensors


def check_layer(encoder: dict[str, Tensor], i: int, shape: tuple[int, int], jump: bool,
                directory: Path) -> None:
    d_tc, d_model = shape
    expected = {f"W_enc_{i}": (d_tc, d_model), f"b_enc_{i}": (d_tc,), f"b_dec_{i}": (d_model,)}
    if jump:
        expected[f"threshold_{i}"] = (d_tc,)
    found = {name: tuple(t.shape) for name, t in encoder.items()}
    if found != expected:
        raise CheckpointError(f"{directory / f'W_enc_{i}.safetensors'}: tensors {found}; the "
                              f"CLT's first layer makes them {expected}")


def read_decoder(directory: Path, i: int, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> Tensor:
    path = directory / f"W_dec_{i}.safetensors"
    with SafetensorsFile(path, CheckpointError) as file:
        if set(file.header) != {f"W_dec_{i}"} or file.header[f"W_dec_{i}"].shape != shape:
            found = {name: info.shape for name, info in file.header.items()}
            raise CheckpointError(f"{path} holds {found}; layer {i} of this CLT needs "
                                  f"W_dec_{i} {shape}")
        check_float_dtypes(file.header, path, CheckpointError)
        tensor = file.read(f"W_dec_{i}", dtype)
    check_finite({f"W_dec_{i}": tensor}, path, CheckpointError)
    return tensor

