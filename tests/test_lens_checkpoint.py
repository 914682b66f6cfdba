"""TransformerLens's checkpoint format both ways (glassgpt.formats.transformer_lens): a glass
model as HookedTransformer.state_dict() and its HookedTransformerConfig, and such a checkpoint
(ARENA's pretrained attention-only model) as a glass model.

Held to: glassgpt itself (a round trip is bit-equal); TransformerLens 4.3, whose converter of
these checkpoints feeds its native bridge, for every config that bridge computes (logits and
patterns); and, for shortformer positions, which TransformerLens 4.3 refuses, a float64 hand
computation of TransformerLens 2.x's shortformer attention from the checkpoint's own tensors.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import warnings

import pytest
import torch

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.formats.transformer_lens import lens_state_dict, model_from_lens_checkpoint
from glassgpt.formats.transformer_lens_config import lens_config_dict
from glassgpt.formats.transformer_lens_files import read_lens_state
from glassgpt.interp import HookedGPT
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model, save_model
from glassgpt.tokenizers import CharTokenizer

SIZES = dict(vocab_size=40, block_size=12, n_layer=2, n_head=4, n_embd=32)
GPT2 = dict(activation="gelu_tanh")
LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", n_kv_head=2, bias=False,
             mlp_hidden=48, tie_weights=False)
ARENA = dict(attn_only=True, norm="none", position="shortformer")  # ARENA part 2's model
# ARENA chapter 1 part 2's HookedTransformerConfig (ARENA_3.0, part2_intro_to_mech_interp),
# its sizes made small: the same fields
ARENA_CFG = dict(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=12, d_vocab=40,
                 attention_dir="causal", attn_only=True, tokenizer_name="EleutherAI/gpt-neox-20b",
                 seed=398, use_attn_result=True, normalization_type=None,
                 positional_embedding_type="shortformer")


def gpt(seed: int = 0, **switches) -> GPT:
    """A tiny GPT, every parameter drawn: gains near 1, the rest small."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SIZES, **switches}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            gain = name.endswith("weight") and param.dim() == 1
            param.copy_((1.0 if gain else 0.0) + 0.2 * torch.randn_like(param))
    return model.eval()


def ids(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 40, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[0]


# --- (a) glass -> property format -> glass ------------------------------------------------------

@pytest.mark.parametrize("switches", [GPT2, LLAMA, ARENA], ids=["gpt2", "llama", "arena"])
def test_a_round_trip_is_bit_equal(switches):
    model = gpt(**switches)
    back = model_from_lens_checkpoint(lens_config_dict(model), lens_state_dict(model))
    assert torch.equal(logits(back, ids()), logits(model, ids()))
    state, again = lens_state_dict(model), lens_state_dict(back)
    assert state.keys() == again.keys()
    assert all(torch.equal(state[name], again[name]) for name in state)
    for switch in ("bias", "tie_weights", "norm", "position", "attn_only", "n_kv_head"):
        assert getattr(back.config, switch) == getattr(model.config, switch), switch


def test_the_keys_and_shapes_are_transformer_lens_2s():
    """Llama-like with grouped K/V: TL's _W_K for the stored K/V heads, W_gate, RMS gains
    only, no position table; its W_Q / W_K equal HookedGPT's TL-layout weights."""
    model = gpt(**LLAMA)
    state = lens_state_dict(model)
    shapes = {name: tuple(t.shape) for name, t in state.items() if name.startswith("blocks.0.")}
    assert shapes == {
        "blocks.0.ln1.w": (32,), "blocks.0.ln2.w": (32,),
        "blocks.0.attn.W_Q": (4, 32, 8), "blocks.0.attn._W_K": (2, 32, 8),
        "blocks.0.attn._W_V": (2, 32, 8), "blocks.0.attn.W_O": (4, 8, 32),
        "blocks.0.attn.b_Q": (4, 8), "blocks.0.attn._b_K": (2, 8), "blocks.0.attn._b_V": (2, 8),
        "blocks.0.attn.b_O": (32,), "blocks.0.attn.mask": (12, 12), "blocks.0.attn.IGNORE": (),
        "blocks.0.mlp.W_in": (32, 48), "blocks.0.mlp.W_gate": (32, 48),
        "blocks.0.mlp.b_in": (48,), "blocks.0.mlp.W_out": (48, 32), "blocks.0.mlp.b_out": (32,)}
    assert {name for name in state if not name.startswith("blocks.")} == \
        {"embed.W_E", "ln_final.w", "unembed.W_U", "unembed.b_U"}
    hooked = HookedGPT(model)
    assert torch.equal(state["blocks.1.attn.W_Q"], hooked.W_Q[1])
    assert torch.equal(state["blocks.1.attn._W_K"].repeat_interleave(2, 0), hooked.W_K[1])
    assert torch.equal(state["blocks.1.mlp.W_gate"], hooked.W_gate[1])
    assert torch.equal(state["blocks.0.attn.mask"], torch.ones(12, 12, dtype=torch.bool).tril())
    assert state["blocks.0.attn.IGNORE"].item() == -math.inf
    assert not state["unembed.b_U"].any() and not state["blocks.0.mlp.b_in"].any()
    arena = lens_state_dict(gpt(**ARENA))
    assert not any(".ln" in name or ".mlp." in name or "ln_final" in name for name in arena)
    assert "pos_embed.W_pos" in arena and "blocks.0.attn.W_K" in arena
    assert hooked.lens_state_dict().keys() == state.keys()


def test_the_config_is_transformer_lens_2s():
    cfg = lens_config_dict(gpt(**ARENA))
    assert {k: cfg[k] for k in ARENA_CFG if k in cfg} == {
        "d_model": 32, "d_head": 8, "n_heads": 4, "n_layers": 2, "n_ctx": 12, "d_vocab": 40,
        "attn_only": True, "tokenizer_name": None, "normalization_type": None,
        "positional_embedding_type": "shortformer"}
    assert cfg["d_mlp"] is None and cfg["act_fn"] is None
    llama = lens_config_dict(gpt(**LLAMA))
    assert {k: llama[k] for k in ("act_fn", "gated_mlp", "normalization_type", "final_rms",
                                  "positional_embedding_type", "rotary_dim", "rotary_base",
                                  "n_key_value_heads", "d_mlp")} == {
        "act_fn": "silu", "gated_mlp": True, "normalization_type": "RMS", "final_rms": True,
        "positional_embedding_type": "rotary", "rotary_dim": 8, "rotary_base": 10000.0,
        "n_key_value_heads": 2, "d_mlp": 48}
    assert lens_config_dict(gpt(**GPT2))["act_fn"] == "gelu_new"
    json.dumps(llama)  # every value is JSON


# --- (b) TransformerLens 4.3's native bridge over the converted checkpoint --------------------

def rotate_half_to_adjacent(state: dict, d_head: int) -> dict:
    """TL 4.3's native rotary turns adjacent pairs (2i, 2i + 1); TL 2.x's default, and
    glassgpt's, pairs (i, i + d/2). The same permutation of every head's query and key
    features leaves q . k as it was and maps one pairing onto the other."""
    half = torch.arange(d_head // 2)
    order = torch.stack([half, half + d_head // 2], dim=1).flatten()
    return {name: t[..., order] if name.endswith(("W_Q", "W_K", "b_Q", "b_K")) else t
            for name, t in state.items()}


NATIVE = {"gpt2": GPT2, "attn_only_ln": dict(attn_only=True), "llama": LLAMA,
          "attn_only_no_norm": dict(attn_only=True, norm="none"),
          "caps_scale_relu_head_dim": dict(activation="relu", attn_softcap=5.0,
                                           logit_softcap=3.0, query_pre_attn_scalar=12.0,
                                           head_dim=16),
          "gelu_exact": dict(activation="gelu", bias=False, qkv_bias=True)}


@pytest.fixture(scope="module")
def lens():
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint
    return TransformerBridge, convert_tl_checkpoint


@pytest.mark.parametrize("name", NATIVE)
def test_transformer_lens_loads_the_export_and_computes_the_same(lens, name):
    bridge_class, convert = lens
    model = gpt(**NATIVE[name])
    cfg, state = lens_config_dict(model), lens_state_dict(model)
    if cfg.get("gated_mlp"):  # the native gated MLP has no biases; ours are zeros
        assert not any(state[k].any() for k in state if k.endswith(("mlp.b_in", "mlp.b_out")))
        state = {k: t for k, t in state.items() if not k.endswith(("mlp.b_in", "mlp.b_out"))}
    if cfg["positional_embedding_type"] == "rotary":
        state = rotate_half_to_adjacent(state, cfg["d_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = bridge_class.boot_native(cfg)
        bridge.load_state_dict(convert(state, bridge.cfg), strict=True)
        with torch.no_grad():
            lens_logits, lens_cache = bridge.run_with_cache(ids())
            ours, cache = HookedGPT(model).run_with_cache(ids())
    torch.testing.assert_close(ours, lens_logits, atol=1e-5, rtol=0)
    for layer in range(2):
        torch.testing.assert_close(cache["pattern", layer], lens_cache["pattern", layer],
                                   atol=1e-6, rtol=0)


# --- shortformer (TL 4.3 refuses it) and ARENA's config ---------------------------------------

def arena_state(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    """A random checkpoint of ARENA_CFG as TransformerLens 2.x saves one (biases drawn, b_U
    zero: a glassgpt head has no bias)."""
    generator = torch.Generator().manual_seed(seed)

    def drawn(*shape: int) -> torch.Tensor:
        return 0.3 * torch.randn(*shape, generator=generator, dtype=dtype)

    H, C, d, V, n = 4, 32, 8, 40, 12
    state = {"embed.W_E": drawn(V, C), "pos_embed.W_pos": drawn(n, C),
             "unembed.W_U": drawn(C, V), "unembed.b_U": torch.zeros(V, dtype=dtype)}
    for layer in range(2):
        a = f"blocks.{layer}.attn."
        state |= {a + "W_Q": drawn(H, C, d), a + "W_K": drawn(H, C, d), a + "W_V": drawn(H, C, d),
                  a + "W_O": drawn(H, d, C), a + "b_Q": drawn(H, d), a + "b_K": drawn(H, d),
                  a + "b_V": drawn(H, d), a + "b_O": drawn(C),
                  a + "mask": torch.ones(n, n, dtype=torch.bool).tril(),
                  a + "IGNORE": torch.tensor(-math.inf)}
    return state


def tl2_shortformer(state: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, list]:
    """TransformerLens 2.x's attention-only, norm-free, shortformer forward pass from the
    checkpoint's tensors: positions join the query and key inputs only, never the stream."""
    T = tokens.shape[1]
    x = state["embed.W_E"][tokens]  # (B, T, C)
    pos = state["pos_embed.W_pos"][:T]  # (T, C)
    patterns = []
    for layer in range(2):
        w = {k.split(".")[-1]: t for k, t in state.items() if k.startswith(f"blocks.{layer}.")}
        q = torch.einsum("btc,hcd->bthd", x + pos, w["W_Q"]) + w["b_Q"]
        k = torch.einsum("btc,hcd->bthd", x + pos, w["W_K"]) + w["b_K"]
        v = torch.einsum("btc,hcd->bthd", x, w["W_V"]) + w["b_V"]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        pattern = scores.masked_fill(~w["mask"][:T, :T], -math.inf).softmax(-1)  # (B, H, T, T)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        x = x + torch.einsum("bqhd,hdc->bqc", z, w["W_O"]) + w["b_O"]
        patterns.append(pattern)
    return x @ state["unembed.W_U"] + state["unembed.b_U"], patterns


def test_a_shortformer_checkpoint_computes_transformer_lens_2s_attention():
    state = arena_state()
    model = model_from_lens_checkpoint(ARENA_CFG, state)
    assert model.config.position == "shortformer" and model.config.norm == "none"
    assert model.config.attn_only and model.tok_emb.weight.dtype == torch.float64
    expected, patterns = tl2_shortformer(state, ids())
    torch.testing.assert_close(logits(model, ids()), expected, atol=1e-10, rtol=0)
    _, cache = HookedGPT(model).run_with_cache(ids())
    for layer in range(2):
        torch.testing.assert_close(cache["pattern", layer], patterns[layer], atol=1e-12, rtol=0)


def test_arenas_config_runs_through_hooked_gpt_from_a_pth_file(tmp_path):
    """ARENA's cells: torch.save'd weights, HookedTransformer(cfg), cache["pattern", 0]."""
    state = arena_state(dtype=torch.float32)
    torch.save(state, tmp_path / "attn_only_2L_half.pth")
    model = HookedGPT.from_lens_checkpoint(ARENA_CFG, tmp_path / "attn_only_2L_half.pth")
    _, cache = model.run_with_cache(ids(batch=1), remove_batch_dim=True)
    _, patterns = tl2_shortformer({k: t.double() if t.is_floating_point() else t
                                   for k, t in state.items()}, ids(batch=1))
    assert cache["pattern", 0].shape == (4, 12, 12)
    torch.testing.assert_close(cache["pattern", 0], patterns[0][0].float(), atol=1e-6, rtol=0)
    assert model.cfg.positional_embedding_type == "shortformer" and model.cfg.n_layers == 2


def test_a_pickle_holding_an_object_is_refused_unrun(tmp_path):
    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "ran"),)

    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"embed.W_E": Payload()}, protocol=2))
    with pytest.raises(CheckpointError, match="weights_only=True"):
        read_lens_state(tmp_path / "evil.pth")
    assert not (tmp_path / "ran").exists()
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="not a state dict"):
        read_lens_state(tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match=".safetensors or .pth"):
        read_lens_state(tmp_path / "weights.pkl")


def test_pre_norms_a_missing_b_u_and_the_tie_are_read_from_the_weights():
    model = gpt(**GPT2)
    with torch.no_grad():  # unit gains, zero shifts: what TL's "LNPre" computes
        for norm in [model.ln_f, *(n for b in model.blocks for n in (b.ln1, b.ln2))]:
            norm.weight.fill_(1.0)
            norm.bias.zero_()
    cfg, state = lens_config_dict(model), lens_state_dict(model)
    bare = {k: t for k, t in state.items() if ".ln" not in f".{k}" and k != "unembed.b_U"}
    back = model_from_lens_checkpoint({**cfg, "normalization_type": "LNPre"}, bare)
    assert torch.equal(logits(back, ids()), logits(model, ids()))
    assert back.config.tie_weights and back.lm_head.weight is back.tok_emb.weight
    state["unembed.W_U"] = state["unembed.W_U"] + 1e-3
    assert not model_from_lens_checkpoint(cfg, state).config.tie_weights


# --- refusals, by name ------------------------------------------------------------------------

@pytest.mark.parametrize("switches,named", [
    (dict(pre_ln=False), "pre_ln=False"), (dict(post_norms=True, norm="rmsnorm"), "post_norms"),
    (dict(sliding_window=4), "sliding_window"), (dict(qk_norm=True), "qk_norm"),
    (dict(norm="rmsnorm", norm_offset=True), "norm_offset"),
    (dict(embed_scale=True), "embed_scale"),
    (dict(activation="relu2"), "relu2"), (dict(position="none"), "position='none'")])
def test_what_transformer_lens_cannot_hold_is_refused_by_name(switches, named):
    with pytest.raises(ConfigError, match=named):
        lens_state_dict(gpt(**switches))
    with pytest.raises(ConfigError, match=named):
        lens_config_dict(gpt(**switches))


@pytest.mark.parametrize("change,named", [
    (dict(parallel_attn_mlp=True), "parallel_attn_mlp=True"),
    (dict(use_local_attn=True), "use_local_attn"), (dict(attention_dir="bidirectional"),
                                                    "attention_dir"),
    (dict(positional_embedding_type="alibi"), "alibi"),
    (dict(attn_only=False, act_fn="solu_ln", d_mlp=64), "solu_ln"),
    (dict(rotary_adjacent_pairs=True), "rotary_adjacent_pairs"),
    (dict(normalization_type="LN", final_rms=True), "final_rms"),
    (dict(some_new_switch=2), "some_new_switch"), (dict(d_vocab_out=7), "d_vocab_out")])
def test_a_config_glassgpt_cannot_compute_is_refused_by_name(change, named):
    with pytest.raises(ConfigError, match=named):
        model_from_lens_checkpoint({**ARENA_CFG, **change}, arena_state())


def test_a_checkpoint_that_does_not_match_is_refused_by_name():
    state = arena_state()

    def load(**changes):
        return model_from_lens_checkpoint(ARENA_CFG, {**state, **changes})

    with pytest.raises(CheckpointError, match=r"missing \['blocks.1.attn.W_Q'\]"):
        model_from_lens_checkpoint(ARENA_CFG, {k: t for k, t in state.items()
                                               if k != "blocks.1.attn.W_Q"})
    with pytest.raises(CheckpointError, match=r"unexpected \['blocks.0.attn.q_norm.w'\]"):
        load(**{"blocks.0.attn.q_norm.w": state["embed.W_E"][0, :8]})
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.W_O has shape \(4, 32, 8\)"):
        load(**{"blocks.0.attn.W_O": state["blocks.0.attn.W_Q"]})
    with pytest.raises(CheckpointError, match="unembed.b_U is not zero"):
        load(**{"unembed.b_U": torch.ones(40, dtype=torch.float64)})
    llama = gpt(**LLAMA)
    gated = lens_state_dict(llama)
    gated["blocks.0.mlp.b_in"] += 1.0
    with pytest.raises(CheckpointError, match="blocks.0.mlp.b_in is not zero"):
        model_from_lens_checkpoint(lens_config_dict(llama), gated)



@pytest.mark.parametrize("model,change,named", [
    ("arena", dict(n_layers=10**6), r"n_layers=1,000,000, and the checkpoint holds 2 layers"),
    ("arena", dict(n_layers=1), r"n_layers=1, and the checkpoint holds 2 layers"),
    ("arena", dict(n_ctx=10**12), r"pos_embed.W_pos has shape \(12, 32\), its config's n_ctx"),
    ("arena", dict(d_vocab=10**12), r"embed.W_E has shape \(40, 32\), its config's d_vocab"),
    ("llama", dict(n_ctx=10**12), r"n_ctx=1,000,000,000,000 is more than glassgpt holds"),
])
def test_a_config_the_checkpoint_does_not_hold_is_refused_before_anything_is_built(
        monkeypatch, model, change, named):
    """Sizes are read off the tensors before a model is built, even on the meta device:
    10**6 layers over two once took minutes and gigabytes, n_ctx=10**12 torch's overflow."""
    from glassgpt.formats import transformer_lens as checkpoint

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the sizes were checked")

    monkeypatch.setattr(checkpoint, "expected_lens_shapes", built)
    if model == "arena":
        cfg, state = ARENA_CFG, arena_state()
    else:
        llama = gpt(**LLAMA)
        cfg, state = lens_config_dict(llama), lens_state_dict(llama)
    with pytest.raises((CheckpointError, ConfigError), match=named):
        HookedGPT.from_lens_checkpoint({**cfg, **change}, state)

# --- (d) glassgpt convert RUN --to-lens OUT ---------------------------------------------------

def saved_run(tmp_path, **switches):
    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,;:!?'\n-ABCD")
    model = gpt(**{**switches, "vocab_size": tokenizer.vocab_size})
    save_model(tmp_path / "run", model, tokenizer)
    return tmp_path / "run"


def test_convert_to_lens_writes_the_two_files_and_replaces_only_its_own(tmp_path, capsys):
    run = saved_run(tmp_path, **ARENA)
    out = tmp_path / "lens"
    assert main(["convert", str(run), "--to-lens", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    glass, _ = load_model(run)
    assert json.loads((out / "config.json").read_text()) == lens_config_dict(glass)
    loaded = HookedGPT.from_lens_checkpoint(out / "config.json", out / "model.safetensors")
    assert torch.equal(logits(loaded.glass, ids()), logits(glass, ids()))
    capsys.readouterr()
    assert main(["convert", str(run), "--to-lens", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--force" in err and len(err.strip().splitlines()) == 1
    assert main(["convert", str(run), "--to-lens", str(out), "--force"]) == 0
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep")
    capsys.readouterr()
    assert main(["convert", str(run), "--to-lens", str(notes), "--force"]) == 2
    assert "does not hold a TransformerLens export" in capsys.readouterr().err
    assert (notes / "mine.txt").read_text() == "keep"


def test_convert_to_lens_refuses_gemma_switches_by_name(tmp_path, capsys):
    run = saved_run(tmp_path, norm="rmsnorm", post_norms=True, norm_offset=True)
    assert main(["convert", str(run), "--to-lens", str(tmp_path / "lens")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "post_norms=True" in err
    assert not (tmp_path / "lens").exists()
    assert main(["convert", str(run), "--to-lens", str(tmp_path / "a"), "--to-hf",
                 str(tmp_path / "b")]) == 2
    assert "one of --to-hf and --to-lens" in capsys.readouterr().err

