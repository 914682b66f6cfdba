"""`AttributionGraph`: the nodes of one prompt's graph and its adjacency matrix, laid out as
circuit-tracer lays out its Graph, and saved as one safetensors file.

Nodes, in the adjacency's order (N = F + L*T + T + K):
    [0, F)                 the active features, by (layer, position, feature)
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

from glassgpt.errors import CheckpointError
from glassgpt.rundir.checkpoint import check_fits_memory
from glassgpt.storage import files
from glassgpt.storage.tensorfile import SafetensorsFile

TENSORS = ("input_ids", "active_features", "activation_values", "logit_tokens",
           "logit_probabilities", "adjacency_matrix")
FORMAT = "glassgpt-attribution-graph"


@dataclass
class AttributionGraph:
    """One prompt's attribution graph. input_ids (T,); active_features (F, 3) long: layer,
    position, feature; activation_values (F,); logit_tokens (K,), logit_probabilities (K,);
    adjacency_matrix (N, N), rows targets and columns sources; transcoders: the hook each
    layer's transcoder writes (None for a layer without one)."""

    input_ids: Tensor
    active_features: Tensor
    activation_values: Tensor
    logit_tokens: Tensor
    logit_probabilities: Tensor
    adjacency_matrix: Tensor
    n_layers: int
    transcoders: list[str | None] = field(default_factory=list)

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
        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in TENSORS}
        metadata = {"format": FORMAT, "n_layers": str(self.n_layers),
                    "transcoders": json.dumps(self.transcoders)}
        path = Path(path)
        files.write_bytes_atomic(path, safetensors_save(tensors, metadata))
        return path

    @classmethod
    def load(cls, path: str | Path) -> AttributionGraph:
        """A graph `save` wrote; anything else is one CheckpointError naming what is wrong."""
        path = Path(path)
        with SafetensorsFile(path, CheckpointError) as file:
            metadata, names = file.metadata, set(file.header)
            if metadata.get("format") != FORMAT or names != set(TENSORS):
                raise CheckpointError(f"{path} is not an attribution graph glassgpt saved "
                                      f"(format {metadata.get('format')!r}, tensors "
                                      f"{sorted(names)})")
            check_fits_memory(file.nbytes, f"the attribution graph in {path}")
            tensors = file.read_all()
        try:
            n_layers = int(metadata["n_layers"])
            transcoders = json.loads(metadata["transcoders"])
        except (KeyError, ValueError) as error:
            raise CheckpointError(f"{path} is not an attribution graph: its metadata lacks "
                                  f"{error}") from None
        graph = cls(**tensors, n_layers=n_layers, transcoders=transcoders)
        if graph.adjacency_matrix.shape != (graph.n_nodes, graph.n_nodes):
            raise CheckpointError(f"{path}: an adjacency of shape "
                                  f"{tuple(graph.adjacency_matrix.shape)} for {graph.n_nodes} "
                                  f"nodes")
        return graph

    def to(self, dtype: torch.dtype) -> AttributionGraph:
        """The same graph with its float tensors in `dtype`."""
        return AttributionGraph(self.input_ids, self.active_features,
                                self.activation_values.to(dtype), self.logit_tokens,
                                self.logit_probabilities.to(dtype),
                                self.adjacency_matrix.to(dtype), self.n_layers,
                                list(self.transcoders))
