"""Every hook point keeps TransformerLens's layout, on every model variant (issue 39).

The convention, by what a point holds: the residual stream and what a sub-layer adds to it
(batch, pos, d_model); a norm's scale (batch, pos, 1); a head's q, k, v, rotated q and k,
their QK-norm and z (batch, pos, head, d_head), K and V with their own head count; each head's
result (batch, pos, head, d_model); scores and pattern (batch, head, query, key); the MLP's
hidden activations (batch, pos, d_mlp). A point that is in none of these rows fails
the test, so a new point has to say which layout it keeps.
Sizes are all distinct (B=2, T=5, C=24, H=4, H_kv=2, d=10, F=40), so a swapped axis shows.
"""

from __future__ import annotations

import re

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.interp import run_with_cache, run_with_hooks
from glassgpt.model import GPT

B, T, C, H, KV, D, F = 2, 5, 24, 4, 2, 10, 40
VARIANTS = {
    "classic": dict(),
    "post-ln": dict(pre_ln=False),
    "relu, untied": dict(activation="relu", tie_weights=False),
    "llama": dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_head=KV,
                  bias=False, head_dim=D),
    "qwen3": dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_head=KV,
                  qk_norm=True, bias=False, head_dim=D),
    "qwen2": dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_head=KV,
                  bias=False, qkv_bias=True),
    "smollm3 nope": dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_head=KV,
                         bias=False, nope_layers=[1]),
    "gemma": dict(position="rope", norm="rmsnorm", activation="geglu", n_kv_head=1,
                  qk_norm=True, bias=False, head_dim=D, post_norms=True, norm_offset=True,
                  sliding_window=3, local_layers=[0], attn_softcap=5.0, logit_softcap=9.0,
                  query_pre_attn_scalar=12, embed_scale=True),
    # ARENA's two-layer model: attention only, no norm, shortformer positions (issue 40)
    "arena": dict(attn_only=True, norm="none", position="shortformer", mlp_hidden=None),
    "attn-only llama": dict(attn_only=True, position="rope", norm="rmsnorm", n_kv_head=KV,
                            bias=False, mlp_hidden=None),
}


def layout_of(name: str, config: GPTConfig) -> tuple[int, ...]:
    """The shape TransformerLens's convention gives the point `name`."""
    H_kv = config.n_kv_head or config.n_head
    d = config.head_dim
    rows = [
        (r"hook_(pos_)?embed|ln_final\.hook_normalized", (B, T, C)),
        (r"(blocks\.\d+\.ln[12](_post)?|ln_final)\.hook_scale", (B, T, 1)),
        (r"blocks\.\d+\.attn\.q_norm\.hook_scale", (B, T, H, 1)),
        (r"blocks\.\d+\.attn\.k_norm\.hook_scale", (B, T, H_kv, 1)),
        (r"blocks\.\d+\.attn\.hook_result", (B, T, H, C)),
        (r"blocks\.\d+\.(hook_(resid_pre|resid_mid|resid_post|attn_out|mlp_in|mlp_out)"
         r"|ln[12](_post)?\.hook_normalized)", (B, T, C)),
        (r"blocks\.\d+\.attn\.(hook_(q|rot_q|z)|q_norm\.hook_normalized)", (B, T, H, d)),
        (r"blocks\.\d+\.attn\.(hook_(k|v|rot_k)|k_norm\.hook_normalized)", (B, T, H_kv, d)),
        (r"blocks\.\d+\.attn\.hook_(attn_scores|pattern)", (B, H, T, T)),
        (r"blocks\.\d+\.mlp\.hook_(pre|pre_linear|post)", (B, T, config.hidden_width)),
    ]
    for pattern, shape in rows:
        if re.fullmatch(pattern, name):
            return shape
    raise AssertionError(f"{name} is in no row of the layout table: say which layout it keeps")


def model_of(switches: dict) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(**{**dict(vocab_size=37, block_size=8, n_layer=2, n_head=H, n_embd=C,
                                 mlp_hidden=F, dropout=0.0), **switches})
    return GPT(config).eval()


@pytest.mark.parametrize("switches", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_point_of_every_variant_keeps_transformer_lens_layout(switches):
    model = model_of(switches)
    ids = torch.randint(0, 37, (B, T), generator=torch.Generator().manual_seed(1))
    _, cache = run_with_cache(model, ids)
    assert len(cache) >= 10
    for name, tensor in cache.items():
        assert tuple(tensor.shape) == layout_of(name, model.config), name


@pytest.mark.parametrize("switches", [VARIANTS["qwen3"], VARIANTS["gemma"]],
                         ids=["qwen3", "gemma"])
def test_a_qk_norm_point_is_patched_in_its_own_layout(switches):
    """A replacement in the shown (batch, pos, head, d) layout lands where it was shown: head
    1 at position 2 switched off there is that head's q at that position only."""
    model = model_of(switches)
    ids = torch.randint(0, 37, (1, T), generator=torch.Generator().manual_seed(2))
    name = "blocks.0.attn.q_norm.hook_normalized"
    _, clean = run_with_cache(model, ids, names=[name])

    def switch_off(x, _name):
        x = x.clone()
        x[:, 2, 1] = 0.0
        return x

    seen = {}
    run_with_hooks(model, ids, [(name, switch_off),
                                ("blocks.0.attn.hook_attn_scores",
                                 lambda x, _name: seen.setdefault("scores", x))])
    _, before = run_with_cache(model, ids, names=["blocks.0.attn.hook_attn_scores"])
    changed = (seen["scores"] != before["blocks.0.attn.hook_attn_scores"]).nonzero().tolist()
    assert changed and {(b, h, q) for b, h, q, _ in changed} == {(0, 1, 2)}
    assert clean[name].shape == (1, T, H, model.config.head_dim)
