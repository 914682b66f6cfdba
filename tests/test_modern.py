"""The modern Transformer's switches, each held to a reference written another way.

RMSNorm against torch.nn.RMSNorm and the formula; rotary against a naive complex-number rotation,
and the property that makes it a relative position code; grouped-query attention against a loop
over heads with repeated keys and values; the per-layer loop and `project`; the
KV cache's size with fewer key/value heads; zero-initialised projections and logit soft-capping.
Shapes: B = batch, T = positions, C = width, H = heads, d = head width.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from glassgpt.attention import MultiHeadSelfAttention, repeat_kv
from glassgpt.block import SwiGLUFeedForward, TransformerBlock, make_activation
from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.hooks import recorded
from glassgpt.model import GPT, count_parameters, eval_mode, parameter_count
from glassgpt.norms import RMSNorm, make_norm
from glassgpt.rotary import RotaryEmbedding

f64 = torch.float64
MODERN = dict(position="rope", norm="rmsnorm", activation="swiglu", mlp_hidden=40, n_kv_head=2,
              qk_norm=True, bias=False)


def tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    settings = dict(vocab_size=31, block_size=16, n_layer=2, n_head=4, n_embd=32) | overrides
    return GPT(GPTConfig(**settings)).eval()


def randomise(module: torch.nn.Module, seed: int = 1) -> None:
    """Give every norm gain and bias a random value, so a test cannot pass on ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias") or ".ln" in name or name.startswith("ln"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


# --- RMSNorm --------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(torch.nn, "RMSNorm"), reason="torch.nn.RMSNorm is newer")
def test_rmsnorm_equals_torchs_in_float64():
    ours, theirs = RMSNorm(24, eps=1e-6).double(), torch.nn.RMSNorm(24, eps=1e-6).double()
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 24, dtype=f64)
    assert (ours(x) - theirs(x)).abs().max() <= 1e-12


def test_rmsnorm_equals_the_formula_and_normalises_each_position_alone():
    norm = RMSNorm(8, eps=1e-5).double()
    x = torch.randn(2, 6, 8, dtype=f64)
    manual = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 8 + 1e-5)
    assert (norm(x) - manual).abs().max() <= 1e-13
    changed = x.clone()
    changed[:, 3] *= 7  # another position's scale must not move this one
    assert torch.equal(norm(changed)[:, :3], norm(x)[:, :3])


def test_rmsnorm_of_bf16_is_computed_in_float32_then_cast_back_as_hugging_face_does():
    norm = RMSNorm(16).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    wide = x.float()
    hf = norm.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert norm(x).dtype == torch.bfloat16 and torch.equal(norm(x), hf)


def test_make_norm_builds_the_named_norm_and_the_manual_layernorm_stays_in_block():
    def config(**switches):
        return GPTConfig(n_embd=8, n_head=1, **switches)
    assert isinstance(make_norm(config(norm="rmsnorm", bias=True)), RMSNorm)
    layer_norm = make_norm(config(norm="layernorm", bias=False))
    assert isinstance(layer_norm, torch.nn.LayerNorm) and layer_norm.bias is None
    assert layer_norm.normalized_shape == (8,) and make_norm(config(), 4).weight.shape == (4,)
    with pytest.raises(ConfigError, match="unknown norm 'batchnorm'"):
        make_norm(config(norm="batchnorm"))


# --- rotary ---------------------------------------------------------------------------------

def naive_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Pair i of the rotate-half layout (features i and i + d/2) as the complex number
    x_i + j x_{i+d/2}, multiplied by exp(j * p * theta^(-2i/d)); one number at a time."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for t, p in enumerate(positions.tolist()):
        for i in range(d // 2):
            z = torch.complex(x[..., t, i], x[..., t, i + d // 2])
            turned = z * complex(math.cos(p * theta ** (-2 * i / d)),
                                 math.sin(p * theta ** (-2 * i / d)))
            out[..., t, i], out[..., t, i + d // 2] = turned.real, turned.imag
    return out


@pytest.mark.parametrize("theta", [10000.0, 100000.0])
def test_rotary_equals_a_naive_complex_rotation_in_float64(theta):
    x = torch.randn(2, 3, 5, 8, dtype=f64)  # (B, H, T, d)
    positions = torch.tensor([0, 1, 2, 7, 300])  # far positions, as at a decoding offset
    rotated = RotaryEmbedding(8, theta)(x, positions)
    assert (rotated - naive_rotary(x, positions, theta)).abs().max() <= 1e-12


def test_rotary_scores_depend_only_on_the_offset_between_positions():
    rotary = RotaryEmbedding(16)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 16, dtype=f64, generator=generator)
    for p, s, shift in [(5, 2, 11), (0, 9, 100), (40, 40, 3), (3, 1, 1000)]:
        def score(a, b):
            qa = rotary(q.view(1, 1, 1, 16), torch.tensor([a]))
            kb = rotary(k.view(1, 1, 1, 16), torch.tensor([b]))
            return (qa * kb).sum().item()
        assert score(p, s) == pytest.approx(score(p + shift, s + shift), abs=1e-10)
    plain = (q * k).sum().item()  # at offset 0 the rotation cancels
    assert rotary(q.view(1, 1, 1, 16), torch.tensor([9])).mul(
        rotary(k.view(1, 1, 1, 16), torch.tensor([9]))).sum().item() == pytest.approx(plain,
                                                                                      abs=1e-12)


# --- grouped-query attention ----------------------------------------------------------------

def per_head_loop(attn: MultiHeadSelfAttention, x: torch.Tensor,
                  pad_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped attention the slow way: each query head h on its own, with the keys and values of
    K/V head h // (H / H_kv), sliced from the rows [Q, K, V] of qkv; then W_O."""
    H, G, d = attn.n_heads, attn.n_kv_head, attn.head_dim
    W = attn.qkv.weight
    Wq, Wk, Wv = W[:H * d], W[H * d:(H + G) * d], W[(H + G) * d:]
    T = x.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    outputs = []
    for h in range(H):
        g = h // (H // G)
        q = x @ Wq[h * d:(h + 1) * d].T  # (B, T, d)
        k, v = x @ Wk[g * d:(g + 1) * d].T, x @ Wv[g * d:(g + 1) * d].T
        scores = q @ k.transpose(1, 2) / math.sqrt(d)  # (B, T, T)
        keep = allowed if pad_mask is None else allowed & ~pad_mask[:, None, :]
        outputs.append(torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v)
    return attn.proj(torch.cat(outputs, dim=-1))


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_grouped_attention_equals_a_per_head_loop_over_repeated_keys_and_values(n_kv_head, impl):
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(32, 4, bias=False, impl=impl, n_kv_head=n_kv_head).double()
    assert attn.qkv.weight.shape == (32 + 2 * n_kv_head * 8, 32)
    x = torch.randn(2, 6, 32, dtype=f64)
    assert (attn(x) - per_head_loop(attn, x)).abs().max() <= 1e-12
    pad = torch.tensor([[False] * 6, [True, False, False, False, False, False]])
    got = attn(x, pad_mask=pad)[1, 1:]  # rows that see at least one real key
    assert (got - per_head_loop(attn, x, pad)[1, 1:]).abs().max() <= 1e-12


def test_repeat_kv_gives_query_head_h_the_kv_head_h_over_group_size():
    kv = torch.arange(2).view(1, 2, 1, 1).float()  # (B, H_kv=2, S, d)
    assert repeat_kv(kv, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]


def test_the_heads_must_split_into_equal_kv_groups():
    with pytest.raises(ConfigError, match=r"n_head=6 is not divisible by n_kv_head=4"):
        GPTConfig(n_head=6, n_embd=48, n_kv_head=4)
    with pytest.raises(ConfigError, match="n_kv_head"):
        MultiHeadSelfAttention(32, 4, n_kv_head=3)


# --- project and the per-layer loop (heads switched off: tests/test_interp.py) ------

def test_project_returns_the_q_k_v_the_forward_attends_with():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(32, 4, bias=False, impl="explicit", n_kv_head=2, qk_norm=True,
                                  rotary=True).double()
    randomise(attn)
    x = torch.randn(2, 5, 32, dtype=f64)
    q, k, v = attn.project(x)
    assert q.shape == (2, 4, 5, 8) and k.shape == v.shape == (2, 2, 5, 8)
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    y = attn.proj((weights @ v).transpose(1, 2).reshape(2, 5, 32))
    assert (attn(x) - y).abs().max() <= 1e-12
    # the steps by hand: QK-norm over each head's d features, then the rotation
    q_raw = x @ attn.qkv.weight[:32].T  # (B, T, C)
    q_heads = q_raw.view(2, 5, 4, 8).transpose(1, 2)
    normed = q_heads / torch.sqrt(q_heads.pow(2).mean(-1, keepdim=True) + 1e-6) \
        * attn.q_norm.weight
    expected_q = naive_rotary(normed, torch.arange(5), 10000.0)
    assert (attn.project(x)[0] - expected_q).abs().max() <= 1e-12


def test_project_at_an_offset_rotates_by_the_absolute_positions():
    attn = MultiHeadSelfAttention(16, 2, rotary=True).double()
    x = torch.randn(1, 3, 16, dtype=f64)
    q_at_5, k_at_5, _ = attn.project(x, start_pos=5)
    q_long, k_long, _ = attn.project(torch.cat([torch.randn(1, 5, 16, dtype=f64), x], 1))
    assert (q_at_5 - q_long[:, :, 5:]).abs().max() <= 1e-12
    assert (k_at_5 - k_long[:, :, 5:]).abs().max() <= 1e-12


def test_the_per_layer_loop_is_what_forward_and_attention_maps_run():
    model = tiny(**MODERN, logit_softcap=5.0)
    idx = torch.randint(0, 31, (2, 7))
    with torch.no_grad():
        streams = [x for _, x in model.layers(idx)]
        assert torch.equal(model.read_out(streams[-1]), model(idx)[0])
        patterns = [block.attn.hook_pattern for block in model.blocks]
        with recorded(*patterns) as weights:  # watched: the explicit path, for the weights
            steps = list(model.layers(idx))
        assert [depth for depth, _ in steps] == [0, 1, 2]
        assert len(weights) == 2 and weights[0].shape == (2, 4, 7, 7)
        maps = model.attention_maps(idx)
    assert all(torch.equal(a, w) for a, w in zip(maps, weights, strict=True))


def test_eval_mode_restores_the_mode_even_after_an_error():
    model = tiny().train()
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not model.training
        raise RuntimeError("inside")
    assert model.training


# --- the model with every switch ------------------------------------------------------------

@pytest.mark.parametrize("switches", [MODERN, dict(MODERN, n_kv_head=1, activation="relu2",
                                                    position="none", qk_norm=False, bias=True)])
def test_the_modern_model_is_causal_and_its_kv_cache_decodes_at_an_offset(switches):
    model = tiny(**switches).double()
    randomise(model)
    idx = torch.randint(0, 31, (2, 12))
    with torch.no_grad():
        full = model(idx)[0]
        changed = idx.clone()
        changed[:, 8] = (changed[:, 8] + 1) % 31
        assert torch.equal(model(changed)[0][:, :8], full[:, :8])  # the future stays hidden
        model.setup_kv_cache(2)
        steps = [model(idx[:, :5], start_pos=0)[0]]
        steps += [model(idx[:, t:t + 1], start_pos=t)[0] for t in range(5, 12)]
        model.remove_kv_cache()
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-10


def test_the_kv_cache_shrinks_by_n_head_over_n_kv_head():
    def cache_bytes(**overrides) -> int:
        model = tiny(n_head=4, **overrides)
        model.setup_kv_cache(2)
        cache = [b.attn.kv_cache for b in model.blocks]
        return sum(c.k.nbytes + c.v.nbytes for c in cache)
    full = cache_bytes()
    assert full == 2 * 2 * 2 * 4 * 16 * 8 * 4  # layers, k and v, B, H, positions, d, fp32
    assert cache_bytes(n_kv_head=2) * 2 == full and cache_bytes(n_kv_head=1) * 4 == full


def test_swiglu_and_relu_squared_are_their_formulas():
    torch.manual_seed(0)
    mlp = SwiGLUFeedForward(8, hidden=12, bias=True).double()
    x = torch.randn(3, 8, dtype=f64)
    gate, up = x @ mlp.gate.weight.T + mlp.gate.bias, x @ mlp.up.weight.T + mlp.up.bias
    expected = (gate * torch.sigmoid(gate) * up) @ mlp.proj.weight.T + mlp.proj.bias
    assert (mlp(x) - expected).abs().max() <= 1e-12
    assert torch.equal(make_activation("relu2")(x), F.relu(x) ** 2)


def test_a_rmsnorm_block_has_no_norm_biases_and_the_shapes_of_the_contract():
    block = TransformerBlock(32, 4, norm="rmsnorm", activation="swiglu", mlp_hidden=40,
                             n_kv_head=2, qk_norm=True, rotary=True, bias=True)
    shapes = {name: tuple(p.shape) for name, p in block.named_parameters()}
    assert shapes == {"ln1.weight": (32,), "attn.qkv.weight": (64, 32), "attn.qkv.bias": (64,),
                      "attn.proj.weight": (32, 32), "attn.proj.bias": (32,),
                      "attn.q_norm.weight": (8,), "attn.k_norm.weight": (8,),
                      "ln2.weight": (32,), "ffn.gate.weight": (40, 32), "ffn.gate.bias": (40,),
                      "ffn.up.weight": (40, 32), "ffn.up.bias": (40,),
                      "ffn.proj.weight": (32, 40), "ffn.proj.bias": (32,)}


def test_rope_and_none_models_have_no_position_table():
    for position in ("rope", "none"):
        names = tiny(position=position).state_dict().keys()
        assert not any(name.startswith("pos_emb") for name in names)
    assert "pos_emb.weight" in tiny().state_dict()


# --- issue 22's model switches --------------------------------------------------------------

def test_zero_init_projections_start_every_block_as_the_identity():
    model = tiny(zero_init_proj=True).train()
    for block in model.blocks:
        assert not block.attn.proj.weight.any() and not block.ffn.proj.weight.any()
    idx = torch.randint(0, 31, (2, 6))
    streams = [x for _, x in model.layers(idx)]
    assert all(torch.equal(x, streams[0]) for x in streams)  # nothing added to the stream yet
    _, loss = model(idx, idx)
    loss.backward()
    assert model.blocks[0].attn.proj.weight.grad.abs().sum() > 0  # but it learns at once
    assert tiny().blocks[0].attn.proj.weight.any()  # off by default


def test_logit_softcap_bounds_the_logits_as_cap_tanh_of_logits_over_cap():
    model = tiny(logit_softcap=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # raw logits far beyond the cap
        idx = torch.randint(0, 31, (2, 6))
        logits = model(idx)[0]
        streams = [x for _, x in model.layers(idx)]
        raw = model.lm_head(model.ln_f(streams[-1]))
    assert raw.abs().max() > 20 and logits.abs().max() <= 2.0  # (float32 tanh reaches 1)
    assert torch.allclose(logits, 2.0 * torch.tanh(raw / 2.0), atol=1e-6)


# --- presets and the config -----------------------------------------------------------------

def test_smollm2_135m_has_exactly_the_parameters_transformers_counts():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("smollm2-135m"))
    assert count_parameters(model) == 134_515_008


def test_cpu_small_modern_is_cpu_smalls_size_with_the_modern_parts():
    modern, small = GPTConfig.from_preset("cpu-small-modern"), GPTConfig.from_preset("cpu-small")
    assert (modern.n_layer, modern.n_head, modern.n_embd, modern.block_size) == (4, 4, 128, 64)
    assert (modern.position, modern.norm, modern.activation, modern.n_kv_head) == \
        ("rope", "rmsnorm", "swiglu", 2)
    with torch.device("meta"):
        counts = count_parameters(GPT(modern)), count_parameters(GPT(small))
    assert counts == (795_904, 809_856)


def test_a_legacy_ln_eps_key_reads_as_norm_eps():
    assert GPTConfig.from_dict({"ln_eps": 1e-6}).norm_eps == 1e-6
    with pytest.raises(ConfigError, match="not both"):
        GPTConfig.from_dict({"ln_eps": 1e-6, "norm_eps": 1e-5})


@pytest.mark.parametrize(("settings", "message"), [
    (dict(position="alibi"), "unknown position 'alibi'"),
    (dict(norm="batchnorm"), "unknown norm 'batchnorm'"),
    (dict(activation="reglu"), "unknown activation 'reglu'"),
    (dict(position="rope", n_head=4, n_embd=12), "head width .* 3 must be even"),
    (dict(mlp_hidden=0), "mlp_hidden must be positive"),
    (dict(n_kv_head=0), "n_kv_head must be positive"),
    (dict(logit_softcap=-1.0), "logit_softcap must be positive"),
    (dict(rope_theta=0.0), "rope_theta must be positive"),
    (dict(qk_norm=1), "qk_norm must be bool"),
])
def test_a_bad_modern_setting_is_a_config_error(settings, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**settings)


def test_a_field_changed_after_construction_is_checked_and_a_bad_value_refused():
    config = GPTConfig(n_layer=2)
    config.n_layer = 3
    assert config.n_layer == 3
    with pytest.raises(ConfigError, match="n_layer must be positive, got -3"):
        config.n_layer = -3
    assert config.n_layer == 3  # the old value stays
    with pytest.raises(ConfigError, match="n_kv_head=5"):
        config.n_kv_head = 5
    assert config.n_kv_head is None


# --- the memory pre-check (issue 19: `train --n-layer 100000`) -------------------------------

def test_the_memory_estimate_of_a_layers_python_objects_stays_above_the_measured_cost():
    import tracemalloc

    from glassgpt.machine.memory import HOST_BYTES_PER_LAYER
    config = GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=4, n_embd=32, **MODERN)
    with torch.device("meta"):
        GPT(config)  # warm up: first-time allocations of torch and Python
        tracemalloc.start()
        model = GPT(dataclasses.replace(config, n_layer=40))
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert len(model.blocks) == 40 and held / 40 < HOST_BYTES_PER_LAYER


def test_a_hundred_thousand_layers_are_refused_for_their_module_objects_alone(monkeypatch):
    from glassgpt.machine import memory
    monkeypatch.setattr(memory, "physical_memory", lambda: 4 * 2**30)
    config = GPTConfig(vocab_size=65, block_size=64, n_layer=100_000, n_head=1, n_embd=8)
    parameters = parameter_count(config)
    parts = memory.model_memory(config, parameters)
    assert parts["weights"] < 2**30 < parts["module objects"]  # the weights alone would fit
    with pytest.raises(ConfigError, match=r"module objects 12\.2 GiB"):
        memory.check_model_fits_memory(config, parameters)


def test_the_python_example_of_docs_modern_runs_and_builds_the_preset(capsys):
    from pathlib import Path
    page = (Path(__file__).parents[1] / "docs" / "modern.md").read_text("utf-8")
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(code, scope)  # the page's own example, as a reader would paste it
    assert scope["config"] == GPTConfig.from_preset("cpu-small-modern")
    assert scope["q"].shape == (1, 4, 8, 32) and scope["k"].shape == (1, 2, 8, 32)
    assert capsys.readouterr().out.splitlines()[-1] == "4 (1, 8, 128) (1, 4, 8, 8)"


def test_eval_mode_is_the_one_place_that_saves_and_restores_a_models_mode():
    from pathlib import Path
    package = Path(__file__).parents[1] / "src" / "glassgpt"
    writers = [path.relative_to(package).as_posix() for path in package.rglob("*.py")
               if "was_training" in path.read_text("utf-8")]
    assert writers == ["model.py"]  # everyone else says `with eval_mode(model):`


def test_one_name_for_the_kv_head_count_and_one_home_for_its_groups():
    """`n_kv_head` everywhere; the group size is `attn.groups`, worked out once in attention."""
    import re
    from pathlib import Path
    root = Path(__file__).parents[1]
    spellings = re.compile(r"\bn_kv_heads\b|\bkv_heads_of\b|\bkv_heads\b")
    group_size = re.compile(r"n_heads? // |// \(?\w*\.?n_kv_head")
    package = root / "src" / "glassgpt"
    for path in [*package.rglob("*.py"), *package.rglob("*.js"), *(root / "tests").glob("*.py"),
                 *(root / "docs").glob("*.md")]:
        if path.name == Path(__file__).name:
            continue
        text = path.read_text("utf-8")
        assert not spellings.search(text), f"{path.name}: {spellings.search(text)[0]}"
        if "src" in path.parts and path.suffix == ".py" and path.name != "attention.py":
            assert not group_size.search(text), f"{path.name}: {group_size.search(text)[0]}"


def test_machine_sits_below_the_model_and_counts_parameters_it_is_given():
    """machine/ imports no model code: the parameter count is computed beside the model
    (`parameter_count`, on the meta device) and handed to the memory checks."""
    import ast
    from pathlib import Path

    from glassgpt.machine import memory
    glass = {"glassgpt.model", "glassgpt.block", "glassgpt.attention", "glassgpt.norms",
             "glassgpt.rotary", "glassgpt.inputs"}
    for path in (Path(__file__).parents[1] / "src" / "glassgpt" / "machine").glob("*.py"):
        tree = ast.parse(path.read_text("utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names}
        assert not imported & glass, f"machine/{path.name} imports {imported & glass}"
    config = GPTConfig(vocab_size=65, block_size=16, n_layer=3, n_head=4, n_embd=32,
                       **dict(MODERN, mlp_hidden=40))
    assert parameter_count(config) == count_parameters(GPT(config))
    assert memory.model_memory(config, 1000)["weights"] == 4000


def test_adding_a_switch_as_reading_the_code_says_is_true_to_the_code():
    """The page's four places name what exists, and the line it edits is the real one."""
    import inspect
    from pathlib import Path

    from glassgpt import attention, block, config, model, norms
    page = (Path(__file__).parents[1] / "docs" / "reading-the-code.md").read_text("utf-8")
    section = page.split("## Adding a switch", 1)[1].split("\n## ", 1)[0]
    for name, where in [("MultiHeadSelfAttention._build", attention),
                        ("MultiHeadSelfAttention.from_config", attention),
                        ("TransformerBlock._build", block), ("TransformerBlock.from_config", block),
                        ("make_mlp", block), ("make_norm", norms), ("parameter_count", model),
                        ("setting", config)]:
        assert name in section, name
        obj = where
        for part in name.split("."):
            obj = getattr(obj, part)
    shown = "nn.Linear(C, self.q_width + 2 * kv_width, bias=config.has_qkv_bias)"
    assert shown in section and shown in inspect.getsource(attention.MultiHeadSelfAttention._build)
    built = inspect.getsource(model.GPT.__init__) + inspect.getsource(block.TransformerBlock._build)
    assert "from_config(config" in built and "make_norm(config)" in built
