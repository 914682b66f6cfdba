"""Hook points and glassgpt.interp on glassgpt's own models (issue 29).

The reference comparison with TransformerLens is tests/test_interp_reference.py; here: every
configuration names its points as TransformerLens does, a point does nothing unless a hook is
attached, hooks never outlive their call, a head switched off equals its slice of W_O removed,
the attribution adds up to the logit, patching a run with its own clean cache gives 1 and with
the corrupted cache 0, and the head scores find a head built to be an induction head.
Shapes: B = batch, T = positions, C = width, H = heads, d = head width.
"""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError, ModelError
from glassgpt.interp import hook_points, patching, run_with_cache, run_with_hooks, zero_heads
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.scores import head_scores, repeated_random_tokens
from glassgpt.model import GPT

CLASSIC = dict()
MODERN = dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_head=2, qk_norm=True,
              bias=False, tie_weights=False)


def tiny(seed: int = 0, **switches) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=4, n_embd=32,
                       dropout=0.0, **switches)
    model = GPT(config).double().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # distinct values everywhere, norm scales included
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return model


def ids(seed: int = 2, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, 29, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("switches", [CLASSIC, MODERN], ids=["classic", "modern"])
def test_every_point_has_its_transformer_lens_name_and_shape(switches) -> None:
    model = tiny(**switches)
    _, cache = run_with_cache(model, ids())
    B, T, H, d, C = 2, 9, 4, 8, 32
    kv = 2 if switches else 4
    hidden = model.config.hidden_width
    expected = {"hook_embed": (B, T, C), "ln_final.hook_normalized": (B, T, C)}
    if not switches:
        expected["hook_pos_embed"] = (B, T, C)
    for layer in range(2):
        block = f"blocks.{layer}."
        expected.update({
            block + "hook_resid_pre": (B, T, C), block + "ln1.hook_normalized": (B, T, C),
            block + "attn.hook_q": (B, T, H, d), block + "attn.hook_k": (B, T, kv, d),
            block + "attn.hook_v": (B, T, kv, d), block + "attn.hook_attn_scores": (B, H, T, T),
            block + "attn.hook_pattern": (B, H, T, T), block + "attn.hook_z": (B, T, H, d),
            block + "hook_attn_out": (B, T, C), block + "hook_resid_mid": (B, T, C),
            block + "ln2.hook_normalized": (B, T, C), block + "mlp.hook_pre": (B, T, hidden),
            block + "mlp.hook_post": (B, T, hidden), block + "hook_mlp_out": (B, T, C),
            block + "hook_resid_post": (B, T, C)})
        if switches:
            expected[block + "attn.hook_rot_q"] = (B, T, H, d)
            expected[block + "attn.hook_rot_k"] = (B, T, kv, d)
    for name, shape in expected.items():
        assert tuple(cache[name].shape) == shape, name
    # the residual stream is what the points say it is
    last = cache["blocks.1.hook_resid_post"]
    assert torch.allclose(model.read_out(last), model(ids())[0], atol=1e-12, rtol=0)
    mid = cache["blocks.0.hook_resid_pre"] + cache["blocks.0.hook_attn_out"]
    assert torch.allclose(mid, cache["blocks.0.hook_resid_mid"], atol=1e-12, rtol=0)


def test_a_point_changes_nothing_and_no_hook_outlives_its_call() -> None:
    model = tiny(**MODERN)
    before = model(ids())[0]
    logits, cache = run_with_cache(model, ids())  # the explicit path: it forms the pattern
    assert torch.allclose(logits, before, atol=1e-12, rtol=0)
    assert len(cache) == len(hook_points(model))

    def fails(tensor, name):
        raise RuntimeError("inside a hook")

    with pytest.raises(RuntimeError, match="inside a hook"):
        run_with_hooks(model, ids(), [("blocks.0.attn.hook_q", fails)])
    assert not any(point._forward_hooks for point in hook_points(model).values())
    assert torch.equal(model(ids())[0], before)


def test_a_hook_may_replace_an_activation_and_a_bad_one_is_named() -> None:
    model = tiny()
    zeroed = run_with_hooks(model, ids(), [("blocks.1.hook_mlp_out",
                                            lambda t, name: torch.zeros_like(t))])
    _, cache = run_with_cache(model, ids())
    expected = model.read_out(cache["blocks.1.hook_resid_mid"])
    assert torch.allclose(zeroed, expected, atol=1e-12, rtol=0)
    with pytest.raises(InputError, match=r"no hook point 'blocks.0.attn.hook_qq'.*hook_q"):
        run_with_cache(model, ids(), names=["blocks.0.attn.hook_qq"])
    with pytest.raises(InputError, match="must return None or a tensor of shape"):
        run_with_hooks(model, ids(), [("hook_embed", lambda t, name: t[:, :1])])
    with pytest.raises(ModelError, match="no hook points"):
        run_with_cache(torch.nn.Linear(2, 2), ids())


def test_switching_a_head_off_equals_removing_its_slice_of_w_o() -> None:
    model = tiny(**MODERN)
    off = run_with_hooks(model, ids(), [("blocks.0.attn.hook_z", zero_heads(1))])
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[:, 8:16] = 0  # head 1 writes through columns 8..15
    assert torch.allclose(off, model(ids())[0], atol=1e-12, rtol=0)
    with pytest.raises(InputError, match="head 4 does not exist"):
        run_with_hooks(model, ids(), [("blocks.0.attn.hook_z", zero_heads(4))])


@pytest.mark.parametrize("switches", [CLASSIC, MODERN], ids=["classic", "modern"])
def test_the_attribution_adds_up_to_the_logit(switches) -> None:
    model = tiny(**switches)
    parts = logit_attribution(model, ids(), token=5, pos=-1)
    assert parts.values.shape == (len(parts.labels),)
    assert abs(parts.values.sum().item() - parts.logit) <= 1e-10
    assert abs(parts.logit - model(ids())[0][:, -1, 5].mean().item()) <= 1e-10
    assert parts.heads.shape == (2, 4) and parts.mlps.shape == (2,)
    difference = logit_attribution(model, ids(), token=5, pos=3, against=7)
    expected = (model(ids())[0][:, 3, 5] - model(ids())[0][:, 3, 7]).mean().item()
    assert abs(difference.values.sum().item() - expected) <= 1e-10


def test_the_attribution_refuses_a_post_ln_model_and_a_token_outside_the_vocabulary() -> None:
    with pytest.raises(ModelError, match="Pre-LN"):
        logit_attribution(tiny(pre_ln=False), ids(), token=1)
    with pytest.raises(InputError, match=r"token must be a token id in \[0, 29\)"):
        logit_attribution(tiny(), ids(), token=29)


@pytest.mark.parametrize("function", ["get_act_patch_resid_pre", "get_act_patch_attn_out",
                                      "get_act_patch_mlp_out",
                                      "get_act_patch_attn_head_out_all_pos",
                                      "get_act_patch_attn_head_out_by_pos"])
def test_patching_with_the_clean_cache_gives_one_and_with_the_corrupted_zero(function) -> None:
    model = tiny(**MODERN)
    clean, corrupted = ids(seed=3), ids(seed=4)
    clean_logits, clean_cache = run_with_cache(model, clean)
    corrupted_logits, corrupted_cache = run_with_cache(model, corrupted)
    metric = patching.normalized_logit_diff(clean_logits, corrupted_logits, answer=3, wrong=8)
    patch = getattr(patching, function)
    assert torch.allclose(patch(model, clean, clean_cache, metric), torch.tensor(1.0),
                          atol=1e-9, rtol=0)
    assert torch.allclose(patch(model, corrupted, corrupted_cache, metric), torch.tensor(0.0),
                          atol=1e-9, rtol=0)
    if function == "get_act_patch_resid_pre":  # prompts that differ in the token at 4 only:
        corrupted = clean.clone()
        corrupted[:, 4] = (clean[:, 4] + 1) % 29
        corrupted_logits, _ = run_with_cache(model, corrupted)
        metric = patching.normalized_logit_diff(clean_logits, corrupted_logits, 3, 8)
        grid = patch(model, corrupted, clean_cache, metric)  # (L, T)
        assert grid.shape == (2, 9)
        assert abs(grid[0, 4].item() - 1.0) <= 1e-9  # the stream there carries all the change
        assert grid[:, :4].abs().max() <= 1e-9  # before it, both runs are the same


def test_an_induction_head_built_by_hand_scores_as_one() -> None:
    """Layer 1 head 0 attends exactly to i - n + 1 once the pattern is replaced: its induction
    score is 1, its previous-token score near 0, and the hand-made pattern of a previous-token
    head in layer 0 scores 1 there."""
    model = tiny()
    n = 8

    def previous_token(pattern, name):
        T = pattern.shape[-1]
        new = torch.zeros_like(pattern)
        new[:, 0, 0, 0] = 1.0
        new[:, 0, torch.arange(1, T), torch.arange(0, T - 1)] = 1.0
        return torch.where(torch.arange(4).view(1, 4, 1, 1) == 0, new, pattern)

    def induction(pattern, name):
        T = pattern.shape[-1]
        new = torch.zeros_like(pattern)
        new[:, 0, torch.arange(T), torch.clamp(torch.arange(T) - n + 1, min=0)] = 1.0
        return torch.where(torch.arange(4).view(1, 4, 1, 1) == 0, new, pattern)

    points = hook_points(model)
    handles = [points["blocks.0.attn.hook_pattern"].register_forward_hook(
                   lambda m, i, o: previous_token(o, "")),
               points["blocks.1.attn.hook_pattern"].register_forward_hook(
                   lambda m, i, o: induction(o, ""))]
    try:
        scores = head_scores(model, half=n)
    finally:
        for handle in handles:
            handle.remove()
    assert scores.previous_token[0, 0] == pytest.approx(1.0)
    assert scores.induction[1, 0] == pytest.approx(1.0)
    assert scores.induction[1, 0] > scores.induction[1, 1:].max()
    assert repeated_random_tokens(29, 4, 2)[:, :4].equal(repeated_random_tokens(29, 4, 2)[:, 4:])
    with pytest.raises(InputError, match="half must be an int"):
        head_scores(model, half=9)
    # tokens of one's own, repeated, give the same scores as the random ones they are
    given = head_scores(model, tokens=repeated_random_tokens(29, 8, 8))
    torch.testing.assert_close(given.induction, head_scores(model, half=8).induction)
    with pytest.raises(InputError, match="second half must equal"):
        head_scores(model, tokens=torch.arange(8).view(1, 8))


def test_the_walk_in_the_docs_runs_on_a_run_trained_by_the_command_line(tmp_path, capsys) -> None:
    """docs/interpretability.md's Python walk, as pasted, on a tiny run of its corpus's kind."""
    import random
    import re
    from pathlib import Path

    from glassgpt.cli import main

    rng = random.Random(0)
    lines = []
    for _ in range(300):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(6, 20)))
        lines.append(f"{word} {word}\n")
    (tmp_path / "repeats.txt").write_text("".join(lines), encoding="utf-8")
    assert main(["prepare", "--text", str(tmp_path / "repeats.txt"), "--out",
                 str(tmp_path / "data")]) == 0
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
                 "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "48",
                 "--position", "rope", "--batch-size", "4", "--max-iters", "2",
                 "--eval-interval", "2", "--eval-iters", "1", "--device", "cpu"]) == 0
    page = (Path(__file__).resolve().parents[1] / "docs" / "interpretability.md").read_text()
    walk = page.split("<!-- section: walk -->")[1]
    code = re.search(r"```python\n(.*?)```", walk, re.DOTALL).group(1)
    assert '"runs/repeats"' in code
    exec(compile(code.replace('"runs/repeats"', repr(str(tmp_path / "run"))),
                 "docs/interpretability.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "strongest induction head: L" in printed and "of the clean answer" in printed
    total, logit = re.search(r"sum (-?[\d.]+) = logit difference (-?[\d.]+)", printed).groups()
    assert abs(float(total) - float(logit)) <= 1e-3


def test_the_tools_hold_for_a_head_width_of_its_own_and_layers_without_rotary() -> None:
    """Qwen3-0.6B's own head width, SmolLM3's NoPE layers and Qwen2's q/k/v-only biases."""
    model = tiny(**MODERN, head_dim=12, nope_layers=[1], qkv_bias=True)
    _, cache = run_with_cache(model, ids())
    assert cache["blocks.0.attn.hook_q"].shape == (2, 9, 4, 12)
    assert cache["blocks.0.attn.hook_z"].shape == (2, 9, 4, 12)
    assert "blocks.0.attn.hook_rot_q" in cache and "blocks.1.attn.hook_rot_q" not in cache
    parts = logit_attribution(model, ids(), token=5)
    assert abs(parts.values.sum().item() - parts.logit) <= 1e-10
    off = run_with_hooks(model, ids(), [("blocks.0.attn.hook_z", zero_heads(2))])
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[:, 24:36] = 0  # head 2's columns of W_O
    assert torch.allclose(off, model(ids())[0], atol=1e-12, rtol=0)
