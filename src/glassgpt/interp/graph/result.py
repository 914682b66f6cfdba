"""`AttributionGraph`: the nodes of one prompt's graph and its adjacency matrix, laid out as
circuit-tracer lays out its Graph, and saved as one safetensors file.

Nodes, in the adjacency's order (N = F + L*T + T + K):
    [0, F)                 the feature nodes, by (layer, position, feature): every active
                           feature, or with max_feature_nodes the ones chosen
    [F, F + L*T)           the error nodes, layer by layer, a position each
    [F + L*T, F + L*T + T) the token embeddings, a position each
    [N - K, N)             the logit nodes, the most probable tokens at the last position
adjacency_matrix[target, source] is the source's direct effect on the target's input (a
feature's pre-activation, a logit minus the mean logit); rows of errors and tokens are zero.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save
from torch import Tensor

from glassgpt.errors import CheckpointError, InputError
from glassgpt.rundir.weights import check_fits_memory
from glassgpt.storage import files
from glassgpt.storage.tensorfile import FLOAT_DTYPES, SafetensorsFile

TENSORS = ("input_ids", "active_features", "activation_values", "logit_tokens",
           "logit_probabilities", "adjacency_matrix")
FLOATS = ("activation_values", "logit_probabilities", "adjacency_matrix")
FORMAT = "glassgpt-attribution-graph"


@dataclass
class AttributionGraph:
    """One prompt's attribution graph. input_ids (T,); active_features (F, 3) long: layer,
    position, feature of each feature node; activation_values (F,); logit_tokens (K,),
    logit_probabilities (K,); adjacency_matrix (N, N), rows targets and columns sources;
    transcoders: the hook each layer's transcoder writes (None for a layer without one);
    n_active_features: how many features were active where max_feature_nodes kept fewer as
    nodes (None: every active feature is a node)."""

    input_ids: Tensor
    active_features: Tensor
    activation_values: Tensor
    logit_tokens: Tensor
    logit_probabilities: Tensor
    adjacency_matrix: Tensor
    n_layers: int
    transcoders: list[str | None] = field(default_factory=list)
    n_active_features: int | None = None

    @property
    def n_active(self) -> int:
        """The features active on the prompt: the nodes' count, or more with a cap."""
        return self.n_features if self.n_active_features is None else self.n_active_features

    @property
    def n_pos(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.active_features.shape[0])

    @property
    def n_errors(self) -> int:
        return self.n_layers * self.n_pos

    @property
    def n_logits(self) -> int:
        return int(self.logit_tokens.shape[0])

    @property
    def n_nodes(self) -> int:
        return self.n_features + self.n_errors + self.n_pos + self.n_logits

    def error_index(self, layer: int, position: int) -> int:
        return self.n_features + layer * self.n_pos + position

    def token_index(self, position: int) -> int:
        return self.n_features + self.n_errors + position

    def logit_index(self, k: int) -> int:
        return self.n_nodes - self.n_logits + k

    @property
    def error_slice(self) -> slice:
        return slice(self.n_features, self.n_features + self.n_errors)

    @property
    def token_slice(self) -> slice:
        return slice(self.n_features + self.n_errors, self.n_features + self.n_errors + self.n_pos)

    @property
    def logit_slice(self) -> slice:
        return slice(self.n_nodes - self.n_logits, self.n_nodes)

    def node(self, index: int) -> dict[str, Any]:
        """What node `index` is: {"kind": "feature"|"error"|"token"|"logit", ...}."""
        if not 0 <= index < self.n_nodes:
            raise IndexError(f"node {index} of {self.n_nodes}")
        if index < self.n_features:
            layer, position, feature = (int(v) for v in self.active_features[index])
            return {"kind": "feature", "layer": layer, "position": position,
                    "feature": feature, "activation": float(self.activation_values[index])}
        index -= self.n_features
        if index < self.n_errors:
            return {"kind": "error", "layer": index // self.n_pos,
                    "position": index % self.n_pos}
        index -= self.n_errors
        if index < self.n_pos:
            return {"kind": "token", "position": index, "token": int(self.input_ids[index])}
        k = index - self.n_pos
        return {"kind": "logit", "position": self.n_pos - 1, "token": int(self.logit_tokens[k]),
                "probability": float(self.logit_probabilities[k])}

    # --- the file ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """One safetensors file, written atomically: the tensors, with n_layers and the
        transcoders' hooks in its metadata."""
        path = files.check_can_write_file(path, InputError)
        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in TENSORS}
        metadata = {"format": FORMAT, "n_layers": str(self.n_layers),
                    "transcoders": json.dumps(self.transcoders)}
        if self.n_active_features is not None:
            metadata["n_active_features"] = str(self.n_active_features)
        path.parent.mkdir(parents=True, exist_ok=True)  # as a picture's folder is made
        files.write_bytes_atomic(path, safetensors_save(tensors, metadata))
        return path

    @staticmethod
    def saved_at(path: str | Path) -> bool:
        """Whether `path` is a file `save` wrote (its header says so; nothing else is read):
        what `glassgpt graph --out --force` may replace."""
        try:
            with SafetensorsFile(Path(path), CheckpointError) as file:
                return file.metadata.get("format") == FORMAT
        except CheckpointError:
            return False

    @classmethod
    def load(cls, path: str | Path) -> AttributionGraph:
        """A graph `save` wrote; anything else is one CheckpointError naming what is wrong:
        the metadata, then each tensor's shape and dtype (before any is read), then their
        values (ids and indices in range, probabilities in [0, 1], no NaN or infinity)."""
        path = Path(path)
        with SafetensorsFile(path, CheckpointError) as file:
            metadata, header = file.metadata, file.header
            if metadata.get("format") != FORMAT or set(header) != set(TENSORS):
                raise CheckpointError(f"{path} is not an attribution graph glassgpt saved "
                                      f"(format {metadata.get('format')!r:.40}, tensors "
                                      f"{sorted(header)[:8]})")
            n_layers, transcoders = read_metadata(metadata, path)
            check_header({name: (info.dtype, info.shape) for name, info in header.items()},
                         n_layers, path)
            check_fits_memory(file.nbytes, f"the attribution graph in {path}")
            tensors = file.read_all()
        graph = cls(**tensors, n_layers=n_layers, transcoders=transcoders,
                    n_active_features=read_count(metadata, "n_active_features", "features", path))
        check_values(graph, path)
        return graph

    def to(self, dtype: torch.dtype) -> AttributionGraph:
        """The same graph with its float tensors in `dtype`."""
        return AttributionGraph(self.input_ids, self.active_features,
                                self.activation_values.to(dtype), self.logit_tokens,
                                self.logit_probabilities.to(dtype),
                                self.adjacency_matrix.to(dtype), self.n_layers,
                                list(self.transcoders), self.n_active_features)


# --- the checks of a file ------------------------------------------------------------------------

def read_metadata(metadata: dict[str, str], path: Path) -> tuple[int, list[str | None]]:
    """(n_layers, transcoders) from the file's metadata: a count, and a JSON list of that many
    hook names (None for a layer without a transcoder)."""
    if "n_layers" not in metadata or "transcoders" not in metadata:
        raise CheckpointError(f"{path} is not an attribution graph: its metadata lacks "
                              f"{'n_layers' if 'n_layers' not in metadata else 'transcoders'}")
    n_layers = read_count(metadata, "n_layers", "layers", path)
    transcoders = files.parse_json(metadata["transcoders"], f"{path} (transcoders)",
                                   CheckpointError)
    if not isinstance(transcoders, list) or len(transcoders) != n_layers or not all(
            hook is None or isinstance(hook, str) for hook in transcoders):
        raise CheckpointError(f"{path}: transcoders must list the {n_layers} layers' hooks "
                              f"(a name or null each), got {metadata['transcoders']!r:.60}")
    return n_layers, transcoders


def read_count(metadata: dict[str, str], name: str, of: str, path: Path) -> int | None:
    """The count of `of` the metadata holds under `name` (at most 9 digits), None where it has
    none."""
    text = metadata.get(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise CheckpointError(f"{path}: {name} must be a count of {of}, got {text!r:.40}")
    return int(text)


def check_header(found: dict[str, tuple[str, tuple[int, ...]]], n_layers: int,
                 path: Path) -> None:
    """Each tensor's dtype and shape, as `save` writes them, from the header alone: ids and
    indices int64, values floating point, and the shapes that fit together."""
    for name, (dtype, _) in found.items():
        want = FLOAT_DTYPES if name in FLOATS else ("I64",)
        if dtype not in want:
            raise CheckpointError(f"{path}: {name} has dtype {dtype}; a graph saves it as "
                                  f"{' or '.join(want)}")
    T, = _shape(found, "input_ids", 1, path)
    F, width = _shape(found, "active_features", 2, path)
    K, = _shape(found, "logit_tokens", 1, path)
    n = F + n_layers * T + T + K
    expected = {"active_features": (F, 3), "activation_values": (F,),
                "logit_probabilities": (K,), "adjacency_matrix": (n, n)}
    for name, shape in expected.items():
        if found[name][1] != shape:
            raise CheckpointError(f"{path}: {name} has shape {found[name][1]}; a graph of {F} "
                                  f"features, {n_layers} layers, {T} tokens and {K} logits "
                                  f"has {shape}")
    if T == 0 or K == 0:
        raise CheckpointError(f"{path}: a graph has at least one token and one logit, this one "
                              f"{T} and {K}")


def _shape(found: dict[str, tuple[str, tuple[int, ...]]], name: str, dims: int,
           path: Path) -> tuple[int, ...]:
    shape = found[name][1]
    if len(shape) != dims:
        raise CheckpointError(f"{path}: {name} has shape {shape}, not {dims} dimension"
                              f"{'s' if dims > 1 else ''}")
    return shape


def check_values(graph: AttributionGraph, path: Path) -> None:
    """The values: ids >= 0, each feature's layer (one with a transcoder), position and index
    in range, probabilities in [0, 1], and every float finite."""
    for name in ("input_ids", "logit_tokens"):
        if int(getattr(graph, name).min()) < 0:
            raise CheckpointError(f"{path}: {name} holds a negative token id")
    if graph.n_features:
        layer, position, feature = graph.active_features.T  # (F,) each
        layers = [index for index, hook in enumerate(graph.transcoders) if hook is not None]
        bad_layer = ~torch.isin(layer, torch.tensor(layers, dtype=layer.dtype))
        for what, bad in (("a layer without a transcoder", bad_layer),
                          (f"a position outside [0, {graph.n_pos})",
                           (position < 0) | (position >= graph.n_pos)),
                          ("a negative feature index", feature < 0)):
            if bool(bad.any()):
                row = int(bad.nonzero()[0])
                raise CheckpointError(f"{path}: active feature {row} "
                                      f"{graph.active_features[row].tolist()} names {what}")
    if graph.n_active < graph.n_features:
        raise CheckpointError(f"{path}: n_active_features is {graph.n_active}, fewer than the "
                              f"graph's {graph.n_features} feature nodes")
    for name in FLOATS:
        values = getattr(graph, name)
        if not bool(torch.isfinite(values).all()):
            bad = int((~torch.isfinite(values)).sum())
            raise CheckpointError(f"{path}: {name} holds {bad:,} NaN or infinite values")
    probabilities = graph.logit_probabilities
    if bool(((probabilities < 0) | (probabilities > 1)).any()):
        raise CheckpointError(f"{path}: logit_probabilities must be in [0, 1], got "
                              f"{probabilities.tolist()[:5]}")
