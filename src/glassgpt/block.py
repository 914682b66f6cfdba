"""The stackable Transformer block: normalisation, attention, feed-forward and two residuals.

Shapes: B = batch, T = positions, C = width, F = the MLP's hidden width (4C by default).
A block maps (B, T, C) -> (B, T, C), which is what makes blocks stackable. Pre-LN or Post-LN is
chosen once, when a block is built: its `forward` calls `pre_ln_sublayers`, `sandwich_sublayers`
(Pre-LN with `post_norms`), `post_ln_sublayers` or `attention_only_sublayers` (`attn_only`: no
MLP), each its formula in straight lines.
The MLPs: `FeedForward` (C -> F -> C with one activation, GPT-2's) and beside it `SwiGLUFeedForward`
(a gated MLP, Llama's and Qwen3's) and `GeGLUFeedForward` (its tanh-GELU sibling, Gemma's). With
`post_norms` (Gemma) each sub-layer's output is normalised too before it joins the residual
stream: four norms a block. The norms live in `glassgpt.norms`.
"""

from __future__ import annotations

from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.config import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    GPTConfig,
    check_choice,
    check_dropout,
    check_heads_divide_width,
    check_size,
)
from glassgpt.errors import ConfigError
from glassgpt.hooks import add_hook_points, recorded
from glassgpt.inputs import check_stream, float_dtype
from glassgpt.norms import make_norm

__all__ = ["FeedForward", "GeGLUFeedForward", "ReLUSquared", "SwiGLUFeedForward",
           "TransformerBlock", "attention_only_sublayers", "make_activation", "make_mlp",
           "post_ln_sublayers", "pre_ln_sublayers", "sandwich_sublayers"]


class ReLUSquared(nn.Module):
    """relu(x)^2: as sparse as ReLU, but smooth at 0 (Primer, So et al. 2021; the speedruns)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.relu().square()


def make_activation(name: str) -> nn.Module:
    """The activation module called `name`; unknown names are a ConfigError listing the choices."""
    check_choice("activation", name, ACTIVATIONS)
    if name in GATED_ACTIVATIONS:
        raise ConfigError(f"{name} is a whole gated MLP (make_mlp builds it), not an activation")
    if name == "relu":
        return nn.ReLU()
    if name == "relu2":
        return ReLUSquared()
    # "gelu" is exact (with erf); "gelu_tanh" is GPT-2's original approximation ("gelu_new").
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """Position-wise MLP C -> F -> C (F = hidden_mult * C unless `hidden` is given), with
    dropout after the second layer."""

    def __init__(self, d_model: int, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True, hidden_mult: int = 4, hidden: int | None = None):
        super().__init__()
        hidden = hidden_mult * d_model if hidden is None else hidden
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.act = make_activation(activation)
        self.proj = nn.Linear(hidden, d_model, bias=bias)
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)
        add_hook_points(self, "hook_pre", "hook_post")

    def forward(self, x: Tensor) -> Tensor:
        pre = self.hook_pre(self.fc(x))  # (B, T, F): before the activation
        post = self.hook_post(self.act(pre))  # (B, T, F)
        return self.dropout(self.proj(post))  # (B, T, C)


class SwiGLUFeedForward(nn.Module):
    """The gated MLP of Llama and Qwen3: proj(silu(gate(x)) * up(x)), C -> 2 x F -> C.

    One branch (gate, through SiLU) decides how much of the other (up) passes, feature by
    feature. Three matrices instead of two, so the hidden width F is usually ~8C/3 rather than 4C
    to keep the parameter count.
    """

    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        check_size("mlp_hidden", hidden, 4 * 2**18)
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)  # `down_proj` in Hugging Face
        self.act = self.make_gate_activation()
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)
        add_hook_points(self, "hook_pre", "hook_pre_linear", "hook_post")

    @staticmethod
    def make_gate_activation() -> nn.Module:
        return nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        pre = self.hook_pre(self.gate(x))  # (B, T, F): the gate before its activation
        linear = self.hook_pre_linear(self.up(x))  # (B, T, F)
        post = self.hook_post(self.act(pre) * linear)  # the gate lets each feature of up through
        return self.dropout(self.proj(post))  # (B, T, C)


class GeGLUFeedForward(SwiGLUFeedForward):
    """Gemma's gated MLP: the same three matrices, the gate through tanh-GELU, not SiLU."""

    @staticmethod
    def make_gate_activation() -> nn.Module:
        return nn.GELU(approximate="tanh")


def make_mlp(config: GPTConfig) -> nn.Module:
    """The block's MLP of `config`: `SwiGLUFeedForward` or `GeGLUFeedForward` for the gated
    activations, else `FeedForward` with that activation; hidden width `config.hidden_width`."""
    C, F = config.n_embd, config.hidden_width
    if config.activation == "swiglu":
        return SwiGLUFeedForward(C, F, config.dropout, config.bias)
    if config.activation == "geglu":
        return GeGLUFeedForward(C, F, config.dropout, config.bias)
    return FeedForward(C, config.activation, config.dropout, config.bias, hidden=F)


class TransformerBlock(nn.Module):
    """One block, Pre-LN (default) or Post-LN, chosen when it is built:

    Pre-LN  (`pre_ln_sublayers`):   u = x + attn(ln1(x));  z = u + ffn(ln2(u))
    Post-LN (`post_ln_sublayers`):  u = ln1(x + attn(x));  z = ln2(u + ffn(u))
    With `post_norms` (Pre-LN only, Gemma) the outputs are normalised as well:
                                  u = x + ln1_post(attn(ln1(x)));  z = u + ln2_post(ffn(ln2(u)))
    With bias and the 4x MLP a block holds exactly 12C^2 + 13C parameters.
    Built from a GPTConfig passed whole (`from_config`, what `GPT` does): `norm` picks `ln1` and
    `ln2`, and the attention and the MLP read their own fields. Standalone, from sizes and
    switches by name: `norm`, `mlp_hidden`, `n_kv_head`, `qk_norm`, `rotary`, `rope_theta` are
    those fields (`rotary` is `position="rope"`).
    """

    def __init__(self, d_model: int, n_heads: int, pre_ln: bool = True, dropout: float = 0.0,
                 activation: str = "gelu", bias: bool = True, causal: bool = True,
                 attn_impl: str = "fused", norm_eps: float = 1e-5, *, norm: str = "layernorm",
                 mlp_hidden: int | None = None, n_kv_head: int | None = None,
                 qk_norm: bool = False, rotary: bool = False, rope_theta: float = 10000.0):
        super().__init__()
        check_heads_divide_width(d_model, n_heads)  # named as the caller named them
        self._build(GPTConfig(n_embd=d_model, n_head=n_heads, pre_ln=pre_ln, dropout=dropout,
                              activation=activation, bias=bias, attn_impl=attn_impl,
                              norm_eps=norm_eps, norm=norm, mlp_hidden=mlp_hidden,
                              n_kv_head=n_kv_head, qk_norm=qk_norm,
                              position="rope" if rotary else "learned", rope_theta=rope_theta),
                    causal)

    @classmethod
    def from_config(cls, config: GPTConfig, causal: bool = True,
                    layer: int = 0) -> TransformerBlock:
        """Block `layer` of `config`: the config passed whole, no field unpacked (the index
        picks the layer's attention kind, e.g. a NoPE layer)."""
        block = cls.__new__(cls)
        nn.Module.__init__(block)
        block._build(config, causal, layer)
        return block

    def _build(self, config: GPTConfig, causal: bool, layer: int = 0) -> None:
        self.pre_ln, self.d_model = config.pre_ln, config.n_embd
        self.ln1 = make_norm(config)
        self.attn = MultiHeadSelfAttention.from_config(config, causal, layer)
        if config.post_norms and not config.pre_ln:
            raise ConfigError("post_norms normalises the sub-layers' outputs of a Pre-LN block; "
                              "a Post-LN block normalises the sums already")
        if config.attn_only:  # TransformerLens's attn_only (ARENA's model): no MLP, no ln2
            self.ln2 = self.ffn = self.ln2_post = None
            self.ln1_post = make_norm(config) if config.post_norms else None
            add_hook_points(self, "hook_resid_pre", "hook_attn_out", "hook_resid_post")
            self.sublayers = attention_only_sublayers
            return
        self.ln2 = make_norm(config)
        self.ffn = make_mlp(config)
        # TransformerLens's names for Gemma's post_attention / post_feedforward norms
        self.ln1_post = make_norm(config) if config.post_norms else None
        self.ln2_post = make_norm(config) if config.post_norms else None
        # Hook points (glassgpt.hooks) on the residual stream and on what each sub-layer adds;
        # `hook_mlp_in` is the MLP branch's copy of the stream (TransformerLens's name): a patch
        # there reaches the MLP alone, one at `hook_resid_mid` the stream as well.
        add_hook_points(self, "hook_resid_pre", "hook_attn_out", "hook_resid_mid",
                        "hook_mlp_in", "hook_mlp_out", "hook_resid_post")
        # The variant's formula, chosen once here; `forward` calls it, so a subclass that
        # overrides `forward` keeps its own.
        self.sublayers = (post_ln_sublayers if not config.pre_ln
                          else sandwich_sublayers if config.post_norms else pre_ln_sublayers)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None, return_attn: bool = False,
                start_pos: int | None = None,
                qk_pos: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, C) -> z (B, T, C) through this block's variant (`sublayers`), or
        (z, weights (B, H, T, S)) with `return_attn`: the attention's `hook_pattern` tensor.
        `qk_pos` (B, T, C): shortformer positions, added to the attention's query and key
        inputs."""
        if return_attn:
            with recorded(self.attn.hook_pattern) as seen:
                z = self.forward(x, pad_mask, start_pos=start_pos, qk_pos=qk_pos)
            return z, seen[0]
        check_stream(x, self.d_model, float_dtype(self.attn.qkv), "block")
        return self.sublayers(self, self.hook_resid_pre(x), pad_mask, start_pos, qk_pos)


def pre_ln_sublayers(block: TransformerBlock, x: Tensor, pad_mask: Tensor | None,
                     start_pos: int | None, qk_pos: Tensor | None = None) -> Tensor:
    """Pre-LN: u = x + attn(ln1(x)); z = u + ffn(ln2(u))."""
    a = block.attn(block.ln1(x), pad_mask=pad_mask, start_pos=start_pos, qk_pos=qk_pos)
    u = block.hook_resid_mid(x + block.hook_attn_out(a))  # (B, T, C): between the two
    f = block.hook_mlp_out(block.ffn(block.ln2(block.hook_mlp_in(u))))
    return block.hook_resid_post(u + f)  # the second residual adds to u, not to x


def sandwich_sublayers(block: TransformerBlock, x: Tensor, pad_mask: Tensor | None,
                       start_pos: int | None, qk_pos: Tensor | None = None) -> Tensor:
    """Pre-LN with `post_norms` (Gemma): each sub-layer's output normalised before it is
    added, so what joins the residual stream has a learned, bounded scale."""
    a = block.attn(block.ln1(x), pad_mask=pad_mask, start_pos=start_pos, qk_pos=qk_pos)
    u = block.hook_resid_mid(x + block.hook_attn_out(block.ln1_post(a)))  # (B, T, C)
    f = block.hook_mlp_out(block.ln2_post(block.ffn(block.ln2(block.hook_mlp_in(u)))))
    return block.hook_resid_post(u + f)


def post_ln_sublayers(block: TransformerBlock, x: Tensor, pad_mask: Tensor | None,
                      start_pos: int | None, qk_pos: Tensor | None = None) -> Tensor:
    """Post-LN (the original Transformer's order): the same parts, each residual sum
    normalised: u = ln1(x + attn(x)); z = ln2(u + ffn(u))."""
    a = block.attn(x, pad_mask=pad_mask, start_pos=start_pos, qk_pos=qk_pos)
    u = block.hook_resid_mid(block.ln1(x + block.hook_attn_out(a)))  # (B, T, C)
    f = block.hook_mlp_out(block.ffn(block.hook_mlp_in(u)))
    return block.hook_resid_post(block.ln2(u + f))


def attention_only_sublayers(block: TransformerBlock, x: Tensor, pad_mask: Tensor | None,
                             start_pos: int | None, qk_pos: Tensor | None = None) -> Tensor:
    """`attn_only` (TransformerLens's, ARENA's two-layer model): the attention and its residual
    alone. Pre-LN: z = x + attn(ln1(x)) (ln1_post(attn(...)) with post_norms); Post-LN:
    z = ln1(x + attn(x))."""
    if not block.pre_ln:
        a = block.attn(x, pad_mask=pad_mask, start_pos=start_pos, qk_pos=qk_pos)
        return block.hook_resid_post(block.ln1(x + block.hook_attn_out(a)))
    a = block.attn(block.ln1(x), pad_mask=pad_mask, start_pos=start_pos, qk_pos=qk_pos)
    if block.ln1_post is not None:
        a = block.ln1_post(a)
    return block.hook_resid_post(x + block.hook_attn_out(a))  # (B, T, C)
