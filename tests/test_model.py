"""The GPT language model: causality, parameter counts, the tied head, GPT-2 init, bad input.

Shapes: B = batch, T = positions, C = n_embd, V = vocab_size, L = n_layer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conftest import attention_with_weights, tiny_config, tiny_gpt
from glassgpt.config import GPTConfig
from glassgpt.errors import InputError
from glassgpt.model import GPT, TransformerLM, count_parameters
from glassgpt.norms import RMSNorm

GPT2_SMALL_PARAMS = 124_439_808


def exact_gpt(**overrides) -> GPT:
    """The shared tiny GPT with a context of 12, in float64 and eval mode: exact comparisons."""
    return tiny_gpt(**{"block_size": 12, **overrides}).double().eval()


def gpt_param_formula(V: int, max_len: int, L: int, C: int) -> int:
    """The spec's count: embeddings, L blocks, final LayerNorm (tied head adds nothing)."""
    return V * C + max_len * C + L * (12 * C**2 + 13 * C) + 2 * C


# --- causality -----------------------------------------------------------------------------

class SequenceNorm(nn.Module):
    """A wrong LayerNorm: statistics over (T, C), so every position sees every other one."""

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(dim=(-2, -1), keepdim=True)  # (B, 1, 1)
        var = x.var(dim=(-2, -1), keepdim=True, unbiased=False)  # (B, 1, 1)
        return (x - mean) / torch.sqrt(var + 1e-5)


def logit_changes(model: GPT, idx: Tensor) -> Tensor:
    """Change each token t + 1 of idx (1, T) in turn; return |logit change| (T - 1, T).

    Row t of the result holds, for every position, the largest change of its logits when
    token t + 1 (and only it) is replaced. All T - 1 variants run as one batch.
    """
    T = idx.shape[1]
    variants = idx.repeat(T - 1, 1)  # (T - 1, T): row t will differ at position t + 1
    rows = torch.arange(T - 1)
    variants[rows, rows + 1] = (variants[rows, rows + 1] + 1) % model.config.vocab_size
    before, _ = model(idx)  # (1, T, V)
    after, _ = model(variants)  # (T - 1, T, V)
    return (after - before).abs().amax(dim=-1)


def past_and_future(changes: Tensor) -> tuple[Tensor, Tensor]:
    """Split changes (T - 1, T) into positions <= t and positions > t of each row t."""
    past = torch.ones_like(changes, dtype=torch.bool).tril()  # row t: positions 0..t
    return changes[past], changes[~past]


@pytest.mark.parametrize("attn_impl", ["fused", "explicit"])
@pytest.mark.parametrize("pre_ln", [True, False], ids=["pre-ln", "post-ln"])
def test_gpt_is_causal(attn_impl, pre_ln):
    model = exact_gpt(attn_impl=attn_impl, pre_ln=pre_ln)
    past, future = past_and_future(logit_changes(model, torch.randint(0, 20, (1, 12))))
    assert past.max() <= 1e-12, "changing token t + 1 changed logits at positions <= t"
    assert future.min() > 1e-6  # while the change does reach position t + 1 and later


def test_norm_over_time_and_width_breaks_causality():
    model = exact_gpt()
    for block in model.blocks:
        block.ln1, block.ln2 = SequenceNorm(), SequenceNorm()
    changes = logit_changes(model, torch.randint(0, 20, (1, 12)))
    # The earliest position sees every later change (the weakest leak of all).
    leak = changes[:, 0]
    print(f"(T, C) norm: smallest change at position 0 from a later token: {leak.min():.2e}")
    assert leak.min() > 1e-6


# --- parameter counts ----------------------------------------------------------------------

@pytest.mark.slow
def test_gpt2_small_has_124_439_808_parameters_both_ways():
    with torch.device("meta"):  # shapes only: no 500 MB of memory, no random init
        from_preset = GPT(GPTConfig.from_preset("gpt2"))
        from_sizes = TransformerLM(50257, d_model=768, n_heads=12, n_layers=12, max_len=1024)
        untied = GPT(GPTConfig.from_preset("gpt2", tie_weights=False))
    assert gpt_param_formula(50257, 1024, 12, 768) == GPT2_SMALL_PARAMS
    assert count_parameters(from_preset) == GPT2_SMALL_PARAMS
    assert count_parameters(from_sizes) == GPT2_SMALL_PARAMS
    # The tied head is counted once; untied it is a second V x C matrix.
    assert count_parameters(untied) == GPT2_SMALL_PARAMS + 50257 * 768
    assert from_preset.lm_head.weight is from_preset.tok_emb.weight


@pytest.mark.parametrize("V, max_len, L, C, H", [(20, 12, 2, 16, 2), (65, 64, 4, 128, 4),
                                                 (100, 32, 3, 48, 6)])
def test_gpt_parameter_formula(V, max_len, L, C, H):
    model = TransformerLM(V, d_model=C, n_heads=H, n_layers=L, max_len=max_len)
    assert count_parameters(model) == gpt_param_formula(V, max_len, L, C)


def test_count_parameters_skips_frozen_ones():
    model = exact_gpt()
    model.pos_emb.weight.requires_grad_(False)
    assert count_parameters(model) == gpt_param_formula(20, 12, 2, 16) - 12 * 16


def test_every_block_is_its_own_module():
    model = exact_gpt(n_layer=4)
    blocks = list(model.blocks)
    assert len({id(b) for b in blocks}) == 4
    pointers = [p.data_ptr() for b in blocks for p in b.parameters()]
    assert len(pointers) == len(set(pointers)), "two blocks share a parameter tensor"
    before = [b.attn.qkv.weight.clone() for b in blocks]
    with torch.no_grad():
        blocks[0].attn.qkv.weight.add_(1.0)
    assert not torch.equal(blocks[0].attn.qkv.weight, before[0])
    for block, old in zip(blocks[1:], before[1:], strict=True):
        assert torch.equal(block.attn.qkv.weight, old)


def test_transformer_lm_builds_the_same_model_as_gpt():
    config = tiny_config(vocab_size=30, block_size=8, n_head=4, n_embd=32, activation="relu",
                         pre_ln=False)
    torch.manual_seed(5)
    gpt = GPT(config)
    torch.manual_seed(5)
    lm = TransformerLM(30, d_model=32, n_heads=4, n_layers=2, max_len=8, activation="relu",
                       pre_ln=False)
    assert lm.config == config
    idx = torch.randint(0, 30, (2, 8))
    assert torch.equal(gpt(idx)[0], lm(idx)[0])


# --- tied head and GPT-2 initialisation ----------------------------------------------------

def test_lm_head_is_tied_to_the_token_embedding():
    model = exact_gpt()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.bias is None
    # The head scores a hidden state against every token's embedding row.
    h = torch.randn(16, dtype=torch.float64)
    assert torch.allclose(model.lm_head(h), model.tok_emb.weight @ h)
    untied = exact_gpt(tie_weights=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_gpt2_initialisation_statistics():
    torch.manual_seed(0)
    L = 4
    model = GPT(GPTConfig(vocab_size=1000, block_size=128, n_layer=L, n_head=4, n_embd=256))
    residual_std = 0.02 / math.sqrt(2 * L)
    for name, param in model.named_parameters():
        if name.endswith(("attn.proj.weight", "ffn.proj.weight")):
            expected = residual_std
        elif name.endswith("weight") and param.dim() == 2:  # linears and embeddings
            expected = 0.02
        elif ".ln" in name or name.startswith("ln_f"):
            fill = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(param == fill), name  # LayerNorm starts as the identity
            continue
        else:
            assert torch.all(param == 0), f"{name} is a bias and must start at zero"
            continue
        std, mean = param.std().item(), param.mean().item()
        assert abs(std / expected - 1) < 0.05, f"{name}: std {std:.5f}, expected {expected:.5f}"
        assert abs(mean) < 0.05 * expected, f"{name}: mean {mean:.2e}"


def test_initial_loss_is_near_uniform():
    model = tiny_gpt(vocab_size=50, n_embd=32)
    idx = torch.randint(0, 50, (4, 16))
    _, loss = model(idx, targets=torch.randint(0, 50, (4, 16)))
    assert abs(loss.item() - math.log(50)) < 0.1


# --- forward -------------------------------------------------------------------------------

def test_loss_is_cross_entropy_and_ignores_minus_one():
    model = exact_gpt()
    idx = torch.randint(0, 20, (2, 12))
    targets = torch.randint(0, 20, (2, 12))
    targets[0, :4] = -1
    logits, loss = model(idx, targets=targets)
    keep = targets != -1
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert logits.shape == (2, 12, 20)
    assert abs(loss.item() - expected.item()) <= 1e-12
    assert model(idx)[1] is None


def test_last_only_returns_the_last_position():
    model = exact_gpt()
    idx = torch.randint(0, 20, (3, 9))
    full, _ = model(idx)
    last, _ = model(idx, last_only=True)
    assert last.shape == (3, 1, 20)
    assert (last - full[:, -1:]).abs().max() <= 1e-12


def test_attention_maps_are_causal_distributions():
    model = exact_gpt(n_layer=3)
    idx = torch.randint(0, 20, (2, 7))
    maps = model.attention_maps(idx)
    assert len(maps) == 3 and all(m.shape == (2, 2, 7, 7) for m in maps)
    for weights in maps:
        assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
        assert torch.all(weights.triu(1) == 0)
    # Layer 0 sees the embeddings directly, so its map can be recomputed from the block.
    x = model.tok_emb(idx) + model.pos_emb.weight[:7]
    assert torch.allclose(maps[0], attention_with_weights(model.blocks[0].attn,
                                                          model.blocks[0].ln1(x))[1])


# --- bad input -----------------------------------------------------------------------------

def test_sequence_longer_than_block_size_is_an_error():
    model = exact_gpt()
    with pytest.raises(InputError, match=r"13 tokens.*block_size=12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(InputError, match=r"14 tokens.*block_size=12"):
        model(torch.zeros(1, 4, dtype=torch.long), start_pos=10)


@pytest.mark.parametrize("bad", [-1, 20, 1000])
def test_token_outside_the_vocabulary_is_an_error(bad):
    model = exact_gpt()
    idx = torch.zeros(2, 5, dtype=torch.long)
    idx[1, 3] = bad
    with pytest.raises(InputError, match=rf"token id {bad} .*\[0, 20\)"):
        model(idx)
    with pytest.raises(InputError, match=rf"token id {bad} "):
        model.attention_maps(idx)


def test_float_token_ids_are_an_input_error():
    model = tiny_gpt(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(InputError, match="token ids must be integers, got dtype torch.float32"):
        model(torch.zeros(1, 3))


def test_ids_checked_where_they_entered_are_not_read_back(monkeypatch):
    """check_ids=False (the trainer, the decoders, eval: their ids were checked on the host)
    never reads ids back from the device: that would be a host sync per step on a GPU."""
    model = tiny_gpt(vocab_size=11, block_size=8, n_layer=1, n_head=1, n_embd=8)
    idx = torch.randint(0, 11, (2, 8))

    def no_reading_back(*args, **kwargs):
        raise AssertionError("token ids were read back")

    monkeypatch.setattr(torch, "aminmax", no_reading_back)
    model(idx, idx, check_ids=False)
    with pytest.raises(AssertionError, match="read back"):
        model(idx)  # a direct call checks (on a GPU, a sync; said in the docstring)


def test_token_ids_must_be_two_dimensional():
    with pytest.raises(InputError, match=r"got shape \(5,\)"):
        exact_gpt()(torch.zeros(5, dtype=torch.long))


# --- the examples of the README and the API page ---------------------------------------------

def test_api_docs_model_example_runs(capsys):
    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text("utf-8")
    section = page.split("<!-- section: api -->", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/api.md (the model)", "exec"), {})
    printed = capsys.readouterr().out
    assert f"{gpt_param_formula(65, 64, 4, 128):,} parameters" in printed  # cpu-small
    assert "torch.Size([2, 3, 5, 5])" in printed


def test_readme_tour_example_runs(capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text("utf-8")
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md (the tour)", "exec"), {})
    printed = capsys.readouterr().out
    assert "795,904 parameters" in printed  # cpu-small-modern
    assert "torch.Size([1, 13])" in printed


def test_the_input_checks_live_in_their_own_module_and_model_py_opens_with_gpt():
    """`glassgpt.inputs` checks ids and targets once each; model.py says what it builds."""
    import glassgpt.model as model_module
    from glassgpt import inputs
    model = exact_gpt()
    idx = torch.randint(0, 20, (2, 5))
    for targets, message in [(idx.float(), "targets must be integers"),
                             (idx[:, :4], r"targets must have the shape .*\(2, 5\)"),
                             (idx.int(), "targets must be integers, got dtype torch.int32"),
                             (torch.full((2, 5), 20), "target 20 is outside the vocabulary")]:
        with pytest.raises(InputError, match=message):
            inputs.check_targets(targets, idx, 20, check_ids=True)
        with pytest.raises(InputError, match=message):
            model(idx, targets)
    source = Path(model_module.__file__).read_text("utf-8")
    assert "def check_" not in source.split("class GPT")[0]  # no checks before the model
    assert "final LayerNorm" not in model_module.__doc__  # the final norm may be RMSNorm
    assert isinstance(tiny_gpt(block_size=12, norm="rmsnorm").ln_f, RMSNorm)
