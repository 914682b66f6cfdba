"""The `config.yaml` circuit-tracer 0.5 keeps beside its transcoders, and its hook names.

circuit-tracer's directory of transcoders (what its cache writes, `save_transcoders_to_cache`,
and what its hub configs say) holds a flat YAML mapping:

    model_kind: transcoder_set | cross_layer_transcoder
    feature_input_hook: ln2.hook_normalized      (a hook point of block L, without "blocks.L.")
    feature_output_hook: hook_mlp_out
    scan: ...                                    (optional: which feature pages go with them)
    transcoders: [layer_0.safetensors, ...]      (optional, a transcoder set's files)

glassgpt writes the same keys and adds one of its own, `glassgpt:` (the activation, a TopK
CLT's k, its hooks in glassgpt's names, where it was trained), which circuit-tracer ignores.

Hooks: circuit-tracer names a point of block L by its name inside the block; glassgpt by its
whole TransformerLens name, "{L}" standing for the layer ("blocks.{L}.ln2.hook_normalized").
circuit-tracer's own MLP points "mlp.hook_in" (the MLP's input, after the norm's gain) and
"mlp.hook_out" (the MLP's output, before a post-MLP norm) have no point of their own in
glassgpt: they are read against a model (glassgpt.interp.sae.circuit_tracer folds the norm's gain
into the encoders).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from glassgpt.errors import CheckpointError
from glassgpt.storage import files

CONFIG_FILE = "config.yaml"
MAX_CONFIG_BYTES = 2**20
CLT_KIND, SET_KIND = "cross_layer_transcoder", "transcoder_set"
# A TopK CLT has no form in circuit-tracer (its load_clt would run it as a ReLU one): glassgpt
# saves it in the same layout under a kind circuit-tracer refuses by name, not silently.
TOPK_CLT_KIND = "glassgpt_topk_cross_layer_transcoder"
KINDS = (CLT_KIND, SET_KIND, TOPK_CLT_KIND)
BLOCK = "blocks.{L}."
# circuit-tracer's points that glassgpt has under the same name (inside block L)
SAME_POINTS = ("ln2.hook_normalized", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out")
MLP_IN, MLP_OUT = "mlp.hook_in", "mlp.hook_out"  # circuit-tracer's own, read against a model


def read_config(directory: Path) -> dict[str, Any]:
    """config.yaml of `directory`, a mapping whose model_kind and hooks are checked."""
    import yaml  # only here: reading a directory of circuit-tracer's needs it

    path = directory / CONFIG_FILE
    text = files.read_text(path, MAX_CONFIG_BYTES, CheckpointError)
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise CheckpointError(f"{path} is not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds no mapping (circuit-tracer's config.yaml: "
                              f"model_kind, feature_input_hook, feature_output_hook)")
    if config.get("model_kind") not in KINDS:
        raise CheckpointError(f"{path}: model_kind {config.get('model_kind')!r:.60} is none of "
                              f"{', '.join(KINDS)}")
    for key in ("feature_input_hook", "feature_output_hook"):
        if not isinstance(config.get(key), str) or not config[key]:
            raise CheckpointError(f"{path}: {key} must name a hook point, got "
                                  f"{config.get(key)!r:.60}")
    own = config.get("glassgpt", {})
    if not isinstance(own, dict):
        raise CheckpointError(f"{path}: glassgpt must be a mapping, got {own!r:.60}")
    config["glassgpt"] = own
    return config


def config_text(kind: str, input_hook: str, output_hook: str,
                own: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> str:
    """config.yaml's text: circuit-tracer's keys, then glassgpt's own (`own`)."""
    import yaml

    config: dict[str, Any] = {"model_kind": kind, "feature_input_hook": input_hook,
                              "feature_output_hook": output_hook, **(extra or {})}
    if own:
        config["glassgpt"] = own
    return yaml.safe_dump(config, sort_keys=False)


def ct_hook(template: str, what: str) -> str:
    """glassgpt's "blocks.{L}.ln2.hook_normalized" -> circuit-tracer's "ln2.hook_normalized"."""
    if not template.startswith(BLOCK) or "{L}" in template[len(BLOCK):]:
        raise CheckpointError(f"circuit-tracer names a point inside each block; the {what} "
                              f"{template!r:.60} is not blocks.{{L}}.<point>")
    return template[len(BLOCK):]


def glass_hook(point: str, source: Path | str, what: str) -> str:
    """circuit-tracer's point inside block L -> glassgpt's template. Its own MLP points become
    "blocks.{L}.mlp.hook_in" / "mlp.hook_out", which no glassgpt model has: read against a
    model (glassgpt.interp.sae.circuit_tracer), they become glassgpt's points."""
    if point in SAME_POINTS + (MLP_IN, MLP_OUT):
        return BLOCK + point
    raise CheckpointError(f"{source}: the {what} {point!r:.60} is no point glassgpt reads "
                          f"({', '.join(SAME_POINTS + (MLP_IN, MLP_OUT))})")


def layer_template(hook_name: str, layer: int, what: str) -> str:
    """"blocks.3.ln2.hook_normalized" at layer 3 -> "blocks.{L}.ln2.hook_normalized"."""
    prefix = f"blocks.{layer}."
    if not hook_name.startswith(prefix):
        raise CheckpointError(f"the {what} {hook_name!r:.60} is not a point of block {layer}")
    return BLOCK + hook_name[len(prefix):]


def indexed_files(directory: Path, stem: str) -> int:
    """How many `{stem}_{i}.safetensors` the directory holds, checked to be i = 0..n-1."""
    found = sorted(p.name for p in directory.glob(f"{stem}_*.safetensors"))
    n = len(found)
    expected = sorted(f"{stem}_{i}.safetensors" for i in range(n))
    if found != expected:
        raise CheckpointError(f"{directory}: the {stem}_i.safetensors files are not numbered "
                              f"0..{n - 1} (found {', '.join(found[:4])}...)")
    return n


def check_replaceable(out: Path, overwrite: bool, owned: Callable[[str], bool], what: str
                      ) -> None:
    """Raise unless `out` (not empty) may be replaced: only with `overwrite`, and only when
    glassgpt wrote it, checked by content: nothing in it but config.yaml and the names `owned`
    accepts, and a config.yaml with glassgpt's own section (a set downloaded from circuit-tracer's
    publishers has none, and is never replaced)."""
    if not overwrite:
        raise CheckpointError(f"{out} is not empty; write elsewhere, or replace the {what} "
                              f"saved there (overwrite=True; glassgpt sae convert --force)")
    foreign = sorted(e.name for e in out.iterdir() if e.name != CONFIG_FILE and not owned(e.name))
    if foreign or not (out / CONFIG_FILE).is_file():
        listed = ", ".join(foreign[:3]) or "no " + CONFIG_FILE
        raise CheckpointError(f"{out} holds more than a {what}'s files ({listed}); it is not "
                              f"replaced")
    try:
        written_here = bool(read_config(out)["glassgpt"])
    except CheckpointError:
        written_here = False
    if not written_here:
        raise CheckpointError(f"{out / CONFIG_FILE} was not written by glassgpt (no glassgpt "
                              f"section); the {what} there is not replaced")

