"""The frozen replacement model's backward pass written out, for the blocks whose linear part it
knows: the rows of an attribution graph in a fraction of autograd's time and memory.

With patterns, norm scales, features and errors frozen (glassgpt.interp.graph.replacement),
what carries a gradient from a target back to the nodes is linear and short. In a Pre-LN block
    x -> u = x + attn(ln1(x)) -> u + mlp_out          (mlp_out a leaf: nothing passes back)
and the attention's only live path is its values, attn(y)[t] = W_O sum_s P[h, t, s] W_V y[s]
(summed over heads h). So the gradient g at a block's output is also the gradient at its
mlp_out (where the layer's features and error write) and at u (where its transcoder reads),
and across the block it becomes
    g_x = g + ln1*( W_V^T P^T W_O^T g )        (ln1*: the norm's adjoint at its frozen scale,
                                                g * gain / scale, centred for a LayerNorm)
Gemma's sandwich norms add ln1_post* before W_O^T. autograd computes the same numbers (the
tests hold the two to each other) over B copies of the whole forward: the MLPs and the LM head
it never needs, Q and K through the fused QKV product, one small product per copy and head for
P^T. Written out, a batch of targets costs two products a layer (W_O^T, W_V^T) and one per
head for P^T over the whole batch, and only for the layers below its highest target and the
positions up to its last (nothing flows to a later position or a higher layer).

Models it does not know (Post-LN blocks, projections wrapped by adapters, hooks left on the
model, dropout at work) go through autograd (build.py), which needs nothing of their structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.block import (
    TransformerBlock,
    attention_only_sublayers,
    pre_ln_sublayers,
    sandwich_sublayers,
)
from glassgpt.interp.core.hooked import hook_points
from glassgpt.interp.graph.replacement import Prompt
from glassgpt.interp.graph.result import AttributionGraph
from glassgpt.model import GPT
from glassgpt.norms import LayerNorm, ManualLayerNorm, RMSNorm

NORMS = (LayerNorm, ManualLayerNorm, RMSNorm, nn.Identity)
PRE_LN = (pre_ln_sublayers, sandwich_sublayers, attention_only_sublayers)

# (layer written into, position, first column, the written vectors (C, n)): the features of one
# layer at one position are a run of columns, their activations times decoder rows one matrix;
# a CLT's features write into several layers, one entry each, their edges the sum.
Writes = list[tuple[int, int, int, Tensor]]


@dataclass
class FrozenNorm:
    """A norm at the prompt's scales, linear: y = centre(x) / scale * gain (+ a shift).
    scale (T, 1); gain (C,) or None for x_hat (no gain); no centring for an RMSNorm."""

    scale: Tensor
    gain: Tensor | None
    centres: bool

    def adjoint(self, g: Tensor, scale: Tensor) -> Tensor:
        """g (..., C) at the output -> the gradient at the input, at `scale` (..., 1): the
        frozen norm's rows at those positions (centring is its own adjoint)."""
        h = g / scale if self.gain is None else g * (self.gain / scale)
        return h - h.mean(-1, keepdim=True) if self.centres else h


def frozen_norm(module: nn.Module, scales: dict[str, Tensor], dtype: torch.dtype,
                gain: bool = True) -> FrozenNorm | None:
    """The norm `module` at the prompt's scales (its hook_scale's); None: no norm."""
    if isinstance(module, nn.Identity):
        return None
    scale = scales[module.hook_scale.name][0].to(dtype)  # (T, 1)
    weight = (module.gain if isinstance(module, RMSNorm) else module.weight).detach().to(dtype)
    return FrozenNorm(scale, weight if gain else None, not isinstance(module, RMSNorm))


def knows(prompt: Prompt) -> bool:
    """Whether the model is one the written-out pass computes exactly: a GPT of Pre-LN blocks
    (plain, sandwich or attention-only) with plain projections and norms, no dropout at work
    and no hook of anyone's attached."""
    glass = prompt.model
    if type(glass) is not GPT or type(glass.lm_head) is not nn.Linear \
            or type(glass.ln_f) not in NORMS:
        return False
    if glass.training and glass.config.dropout > 0:
        return False
    if any(point.active for point in hook_points(glass).values()):
        return False
    return all(_known_block(block) for block in glass.blocks)


def _known_block(block: nn.Module) -> bool:
    if type(block) is not TransformerBlock or not block.pre_ln or block.sublayers not in PRE_LN:
        return False
    attn = block.attn
    parts = (type(attn) is MultiHeadSelfAttention and type(attn.qkv) is nn.Linear
             and type(attn.proj) is nn.Linear)
    norms = [block.ln1, block.ln2, block.ln1_post, block.ln2_post]
    return parts and all(norm is None or type(norm) in NORMS for norm in norms)


@dataclass
class BlockPath:
    """What of block l carries a gradient: the frozen ln1 (and ln1_post), the pattern (H, T,
    T), W_O (C, H*d) and W_V (n_kv*d, C)."""

    ln1: FrozenNorm | None
    post: FrozenNorm | None
    pattern: Tensor
    w_o: Tensor
    w_v: Tensor
    attn: MultiHeadSelfAttention

    def adjoint(self, g: Tensor) -> Tensor:
        """g (B, T', C) at u, the first T' positions -> what the attention branch passes back
        to x (B, T', C)."""
        B, T = g.shape[:2]
        attn = self.attn
        if self.post is not None:
            g = self.post.adjoint(g, self.post.scale[:T])
        g_z = (g @ self.w_o).view(B, T, attn.n_heads, attn.head_dim)  # (B, T, H, d)
        g_v = torch.einsum("hts,bthd->bshd", self.pattern[:, :T, :T], g_z)  # (B, T, H, d)
        g_v = g_v.reshape(B, T, attn.n_kv_head, attn.groups, attn.head_dim).sum(3)
        g_x = g_v.flatten(2) @ self.w_v  # (B, T, n_kv * d) -> (B, T, C)
        return g_x if self.ln1 is None else self.ln1.adjoint(g_x, self.ln1.scale[:T])


def block_path(prompt: Prompt, layer: int, dtype: torch.dtype) -> BlockPath:
    block = prompt.model.blocks[layer]
    attn = block.attn
    kv_width = attn.n_kv_head * attn.head_dim
    post = None if block.ln1_post is None else frozen_norm(block.ln1_post, prompt.scales, dtype)
    return BlockPath(frozen_norm(block.ln1, prompt.scales, dtype), post,
                     prompt.patterns[attn.hook_pattern.name][0].to(dtype),
                     attn.proj.weight.detach().to(dtype),
                     attn.qkv.weight.detach()[attn.q_width + kv_width:].to(dtype), attn)


class WrittenBackward:
    """The rows of a graph's targets (node indices: features, then logits) by the written-out
    pass: `rows_of(chunk)` -> (len(chunk), F + L*T + T), an edge from every source."""

    def __init__(self, prompt: Prompt, graph: AttributionGraph, writes: Writes):
        glass = prompt.model
        self.prompt, self.graph = prompt, graph
        self.dtype = prompt.errors.dtype
        self.features = graph.active_features.to(prompt.errors.device)  # (F, 3), read each batch
        self.out_dtype = torch.promote_types(self.dtype, torch.float32)
        self.blocks = [block_path(prompt, layer, self.dtype) for layer in range(prompt.n_layers)]
        self.final = frozen_norm(glass.ln_f, prompt.scales, self.dtype)
        w_u = glass.lm_head.weight.detach()  # (V, C)
        self.logit_directions = (w_u[graph.logit_tokens.to(w_u.device)]
                                 - w_u.mean(0)).to(self.dtype)  # (K, C): logit - mean logit
        self.reads = [None if sae is None else self.read_norm(layer, sae.cfg.hook_name)
                      for layer, sae in enumerate(prompt.transcoders)]
        self.writes: list[Writes] = [[] for _ in range(prompt.n_layers)]
        for write in writes:
            self.writes[write[0]].append(write)

    def read_norm(self, layer: int, hook: str) -> FrozenNorm | None:
        """How the transcoder of `layer` reads u: through ln2 without its gain (x_hat), or
        as it is (hook_mlp_in, hook_resid_mid)."""
        if not hook.endswith("ln2.hook_normalized"):
            return None
        return frozen_norm(self.prompt.model.blocks[layer].ln2, self.prompt.scales, self.dtype,
                           gain=False)

    @torch.no_grad()
    def __call__(self, chunk: list[int]) -> Tensor:
        layers, positions, vectors = self.cotangents(chunk)
        return self.rows(layers, positions, vectors)

    def cotangents(self, chunk: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Each target as a gradient injected into the residual stream: its layer (L for the
        logits: after the last block), position and vector (n, C)."""
        graph, prompt = self.graph, self.prompt
        device = prompt.errors.device
        index = torch.tensor(chunk, dtype=torch.long, device=device)
        is_feature = index < graph.n_features
        features = torch.zeros(len(chunk), 3, dtype=torch.long, device=device)
        features[is_feature] = self.features[index[is_feature]]
        layers = torch.where(is_feature, features[:, 0], prompt.n_layers)
        positions = torch.where(is_feature, features[:, 1], graph.n_pos - 1)
        vectors = prompt.errors.new_zeros(len(chunk), prompt.errors.shape[-1])  # (n, C)
        for layer in layers[is_feature].unique().tolist():
            here = is_feature & (layers == layer)
            sae, read = prompt.transcoders[layer], self.reads[layer]
            vectors[here] = self._read(sae.W_enc[:, features[here, 2]].T, read, positions[here])
        logits = ~is_feature
        if logits.any():
            k = index[logits] - graph.logit_index(0)
            vectors[logits] = self._read(self.logit_directions[k], self.final, positions[logits])
        return layers, positions, vectors

    def _read(self, directions: Tensor, norm: FrozenNorm | None, positions: Tensor) -> Tensor:
        """directions (n, C) read after `norm` -> the gradient they put on its input."""
        directions = directions.detach().to(self.dtype)
        return directions if norm is None else norm.adjoint(directions, norm.scale[positions])

    def rows(self, layers: Tensor, positions: Tensor, vectors: Tensor) -> Tensor:
        """(n,) layers, (n,) positions, (n, C) injected gradients -> (n, F + L*T + T) edges."""
        graph, n_layers = self.graph, self.prompt.n_layers
        end = int(positions.max()) + 1  # nothing flows to a later position
        top = int(layers.max())
        batch = torch.arange(len(layers), device=vectors.device)
        out = torch.zeros(len(layers), graph.n_nodes - graph.n_logits, dtype=self.out_dtype,
                          device=vectors.device)
        g = vectors.new_zeros(len(layers), end, vectors.shape[-1])  # (n, T', C)
        for layer in range(min(top, n_layers), -1, -1):
            if layer < top:  # g is the gradient at block `layer`'s output: its nodes' edges
                self.edges(layer, g, out)
            here = layers == layer
            if here.any():
                g[batch[here], positions[here]] += vectors[here]
            if layer < n_layers:
                g = g + self.blocks[layer].adjoint(g)
        tokens = graph.token_index(0)
        out[:, tokens:tokens + end] = torch.einsum("btc,tc->bt", g, self.prompt.embed[:end])
        return out

    def edges(self, layer: int, g: Tensor, out: Tensor) -> None:
        """Block `layer`'s features' and error's edges from g (B, T', C), the gradient at
        its mlp_out, into out's columns."""
        if layer == self.prompt.n_layers:
            return
        end = g.shape[1]
        for _, position, start, written in self.writes[layer]:
            if position < end:
                out[:, start:start + written.shape[1]] += g[:, position] @ written  # (B, n)
        at = self.graph.error_index(layer, 0)
        out[:, at:at + end] = torch.einsum("btc,tc->bt", g, self.prompt.errors[layer, :end])
