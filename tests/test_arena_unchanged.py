"""ARENA's and TransformerLens's own code, unchanged, on a glassgpt model (issue 40).

A two-layer attention-only glassgpt model is trained here on repeated random tokens, saved as a
run, and exported to Hugging Face as GPT-2 (`convert --to-hf`'s library function; its MLPs
one unit wide and zero). Each excerpt below runs twice: on `HookedGPT.from_run(run)` with
glassgpt's FactoredMatrix and utils, and on TransformerLens 4.3's TransformerBridge over the
exported weights with TransformerLens's; every result must agree within 1e-5.

The excerpts are short cuts of ARENA 3.0's solutions (ARENA_3.0,
chapter1_transformer_interp/exercises/part2_intro_to_mech_interp/solutions.py), each named
where it stands, with `model`, `FactoredMatrix` and `utils` passed in instead of read from the
notebook's globals, and TransformerLens's tests/unit/test_patching.py cases.

The model: the repeat has one length (n = 8 after BOS, as ARENA's seq_len), so in ~150 steps
layer 0 learns to look back n - 1 positions and predicts the repeat; ARENA's induction detector
finds those heads (a stripe score of ~0.9). The two-step induction circuit, which no position
gives away, is `glassgpt demo induction`'s run (its repeats start at every offset): the
detectors, the score hook and the ablations run on it too, on both sides, and find the
induction heads in layer 1, where the circuit puts them.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")
os.environ.setdefault("WANDB_MODE", "disabled")

import transformer_lens  # noqa: E402
from transformer_lens import patching as lens_patching  # noqa: E402
from transformer_lens import utilities as lens_utils  # noqa: E402 (4.x: what `utils` was)
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

from conftest import quick_experiment  # noqa: E402
from glassgpt.config import GPTConfig  # noqa: E402
from glassgpt.formats.convert import export_run  # noqa: E402
from glassgpt.interp import patching, utils  # noqa: E402
from glassgpt.interp.hooked_gpt import HookedGPT  # noqa: E402
from glassgpt.interp.hooked_gpt.factored import FactoredMatrix  # noqa: E402
from glassgpt.model import GPT  # noqa: E402
from glassgpt.rundir.checkpoint import save_model  # noqa: E402
from glassgpt.tokenizers import BPETokenizer  # noqa: E402

TOL = 1e-5
SEQ_LEN = 8  # ARENA's seq_len: rep_tokens are BOS + 8 random tokens + the same 8
BOS = 0  # <|endoftext|>, the first token of a BPE tokenizer trained here


def repeated_tokens(batch: int, generator: torch.Generator, seq_len: int = SEQ_LEN,
                    vocab: int = 257) -> torch.Tensor:
    """(batch, 1 + 2 * seq_len): BOS, seq_len random tokens, the same again (ARENA's
    rep_tokens)."""
    half = torch.randint(1, vocab, (batch, seq_len), generator=generator)
    return torch.cat([torch.full((batch, 1), BOS), half, half], dim=1)


def trained_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=1 + 2 * SEQ_LEN, n_layer=2, n_head=4,
                          n_embd=32, attn_only=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = torch.Generator().manual_seed(0)
    for _ in range(150):
        tokens = repeated_tokens(32, data)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """{"glassgpt": ..., "transformer_lens": ...}: each a model with its FactoredMatrix and
    utils, over the same weights."""
    tmp = tmp_path_factory.mktemp("arena")
    tokenizer = BPETokenizer.train("The cat sat. The dog ran.", 257)  # the bytes and BOS
    save_model(tmp / "run", trained_model(), tokenizer)
    export_run(tmp / "run", tmp / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
    bridge = TransformerBridge.boot_transformers(
        str(tmp / "hf"), hf_model=hf_model, device="cpu",
        tokenizer=transformers.AutoTokenizer.from_pretrained(tmp / "hf"))
    bridge.set_use_attn_result(True)  # hook_result, which HookedTransformer's cfg switched on
    return both_sides(tmp / "run", bridge, SEQ_LEN, 257)


def both_sides(run, bridge, seq_len: int, vocab: int) -> dict[str, SimpleNamespace]:
    """The two sides of one run: its HookedGPT with glassgpt's FactoredMatrix and utils, and
    TransformerLens's bridge with TransformerLens's; each with ARENA's seq_len and tokens."""
    def tokens(batch: int = 1) -> torch.Tensor:
        return repeated_tokens(batch, torch.Generator().manual_seed(123), seq_len, vocab)

    return {"glassgpt": SimpleNamespace(model=HookedGPT.from_run(run), utils=utils,
                                        FactoredMatrix=FactoredMatrix, seq_len=seq_len,
                                        rep_tokens=tokens),
            "transformer_lens": SimpleNamespace(model=bridge, utils=lens_utils,
                                                FactoredMatrix=transformer_lens.FactoredMatrix,
                                                seq_len=seq_len, rep_tokens=tokens)}


@pytest.fixture(scope="module")
def induction_sides(tmp_path_factory):
    """The same two sides over `glassgpt demo induction --quick`'s run (seed 0): a two-layer
    attention-only model with rotary positions, trained on repeats of every offset, so its
    layer-1 heads are induction heads by the two-step circuit, not by position. It exports as
    GPT-NeoX whose MLPs are zero."""
    tmp = tmp_path_factory.mktemp("demo")
    run = quick_experiment("induction", tmp / "out", seed=0).numbers["run"]
    export_run(run, tmp / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
    bridge = TransformerBridge.boot_transformers(
        str(tmp / "hf"), hf_model=hf_model, device="cpu",
        tokenizer=transformers.AutoTokenizer.from_pretrained(tmp / "hf"))
    return both_sides(run, bridge, 15, 64)  # BOS + 15 + 15: the run's 32 positions


def on_both(sides, excerpt, *args):
    """excerpt(side, *args) on each side, under no_grad (ARENA's t.set_grad_enabled(False))."""
    with torch.no_grad():
        return excerpt(sides["glassgpt"], *args), excerpt(sides["transformer_lens"], *args)


def assert_equal(ours, theirs):
    if isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=TOL, rtol=0)
    elif isinstance(ours, float):
        assert abs(ours - theirs) <= TOL, (ours, theirs)
    else:
        assert ours == theirs


# --- ARENA: the detectors (section 2, "Finding induction heads") ----------------------------

def detectors(side, threshold=0.4):
    model = side.model
    _, cache = model.run_with_cache(side.rep_tokens(), remove_batch_dim=True)

    def current_attn_detector(cache):  # ARENA, solutions.py
        attn_heads = []
        for layer in range(model.cfg.n_layers):
            for head in range(model.cfg.n_heads):
                attention_pattern = cache["pattern", layer][head]
                score = attention_pattern.diagonal().mean()
                if score > threshold:
                    attn_heads.append(f"{layer}.{head}")
        return attn_heads

    def prev_attn_detector(cache):  # ARENA, solutions.py
        attn_heads = []
        for layer in range(model.cfg.n_layers):
            for head in range(model.cfg.n_heads):
                attention_pattern = cache["pattern", layer][head]
                score = attention_pattern.diagonal(-1).mean()
                if score > threshold:
                    attn_heads.append(f"{layer}.{head}")
        return attn_heads

    def induction_attn_detector(cache):  # ARENA, solutions.py
        attn_heads = []
        for layer in range(model.cfg.n_layers):
            for head in range(model.cfg.n_heads):
                attention_pattern = cache["pattern", layer][head]
                seq_len = (attention_pattern.shape[-1] - 1) // 2
                score = attention_pattern.diagonal(-seq_len + 1).mean()
                if score > threshold:
                    attn_heads.append(f"{layer}.{head}")
        return attn_heads

    return (current_attn_detector(cache), prev_attn_detector(cache),
            induction_attn_detector(cache))


def test_arena_detectors_find_the_same_heads(sides):
    ours, theirs = on_both(sides, detectors)
    assert ours == theirs
    assert ours[2], "the trained model has heads ARENA's induction detector finds"


# --- ARENA: induction_score_hook with hook.layer() (section 3, "Hooks") ----------------------

def induction_scores(side):
    model, seq_len = side.model, side.seq_len
    induction_score_store = torch.zeros((model.cfg.n_layers, model.cfg.n_heads),
                                        device=model.cfg.device)

    def induction_score_hook(pattern, hook):  # ARENA, solutions.py
        induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
        induction_score = induction_stripe.mean(dim=(0, 2))  # einops.reduce "... -> head" mean
        induction_score_store[hook.layer(), :] = induction_score

    pattern_hook_names_filter = lambda name: name.endswith("pattern")  # noqa: E731 (ARENA's)
    model.run_with_hooks(side.rep_tokens(10), return_type=None,
                         fwd_hooks=[(pattern_hook_names_filter, induction_score_hook)])
    return induction_score_store


def test_arena_induction_score_hook_reads_hook_layer(sides):
    ours, theirs = on_both(sides, induction_scores)
    assert_equal(ours, theirs)
    assert ours.max() > 0.5


# --- ARENA: logit attribution from cache["embed"], cache["result", l] and W_U ---------------

def logit_attributions(side):
    model = side.model
    tokens = side.rep_tokens()
    _, cache = model.run_with_cache(tokens, remove_batch_dim=True)

    def logit_attribution(embed, l1_results, l2_results, W_U, tokens):  # noqa: N803 (ARENA's)
        W_U_correct_tokens = W_U[:, tokens[1:]]  # noqa: N806
        direct = torch.einsum("es,se->s", W_U_correct_tokens, embed[:-1])
        l1 = torch.einsum("es,sne->sn", W_U_correct_tokens, l1_results[:-1])
        l2 = torch.einsum("es,sne->sn", W_U_correct_tokens, l2_results[:-1])
        return torch.concat([direct.unsqueeze(-1), l1, l2], dim=-1)

    return logit_attribution(cache["embed"], cache["result", 0], cache["result", 1], model.W_U,
                             tokens[0])


def test_arena_logit_attribution_reads_embed_result_and_w_u(sides):
    ours, theirs = on_both(sides, logit_attributions)
    assert ours.shape == (2 * SEQ_LEN, 1 + 2 * 4)
    assert_equal(ours, theirs)


# --- ARENA: head_ablation_hook and get_ablation_scores --------------------------------------

def ablation_scores(side):
    model, utils = side.model, side.utils

    def head_ablation_hook(v, hook, head_index_to_ablate):  # ARENA, solutions.py
        v[:, :, head_index_to_ablate, :] = 0.0
        return v

    def cross_entropy_loss(logits, tokens):  # ARENA, solutions.py
        log_probs = F.log_softmax(logits, dim=-1)
        pred_log_probs = torch.gather(log_probs[:, :-1], -1, tokens[:, 1:, None])[..., 0]
        return -pred_log_probs.mean()

    def get_ablation_scores(model, tokens):  # ARENA, solutions.py (without tqdm)
        ablation_scores = torch.zeros((model.cfg.n_layers, model.cfg.n_heads),
                                      device=model.cfg.device)
        model.reset_hooks()
        logits = model(tokens, return_type="logits")
        loss_no_ablation = cross_entropy_loss(logits, tokens)
        for layer in range(model.cfg.n_layers):
            for head in range(model.cfg.n_heads):
                temp_hook_fn = functools.partial(head_ablation_hook, head_index_to_ablate=head)
                ablated_logits = model.run_with_hooks(tokens, fwd_hooks=[
                    (utils.get_act_name("v", layer), temp_hook_fn)])
                loss = cross_entropy_loss(ablated_logits, tokens)
                ablation_scores[layer, head] = loss - loss_no_ablation
        return ablation_scores

    return get_ablation_scores(model, side.rep_tokens())


def test_arena_ablation_scores(sides):
    ours, theirs = on_both(sides, ablation_scores)
    assert_equal(ours, theirs)
    assert ours.abs().max() > 0.1  # ablating a head the model uses costs loss


# --- ARENA: composition scores, from W_Q @ W_K^T and from FactoredMatrix circuits ------------

def composition_scores(side):
    model, FactoredMatrix = side.model, side.FactoredMatrix  # noqa: N806

    def get_comp_score(W_A, W_B):  # noqa: N803 (ARENA, solutions.py)
        W_A_norm = W_A.pow(2).sum().sqrt()  # noqa: N806
        W_B_norm = W_B.pow(2).sum().sqrt()  # noqa: N806
        W_AB_norm = (W_A @ W_B).pow(2).sum().sqrt()  # noqa: N806
        return (W_AB_norm / (W_A_norm * W_B_norm)).item()

    def get_batched_comp_scores(W_As, W_Bs):  # noqa: N803 (ARENA, solutions.py)
        W_As = FactoredMatrix(W_As.A.reshape(-1, 1, *W_As.A.shape[-2:]),  # noqa: N806
                              W_As.B.reshape(-1, 1, *W_As.B.shape[-2:]))
        W_Bs = FactoredMatrix(W_Bs.A.reshape(1, -1, *W_Bs.A.shape[-2:]),  # noqa: N806
                              W_Bs.B.reshape(1, -1, *W_Bs.B.shape[-2:]))
        W_ABs = W_As @ W_Bs  # noqa: N806
        return W_ABs.norm() / (W_As.norm() * W_Bs.norm())

    W_QK = model.W_Q @ model.W_K.transpose(-1, -2)  # noqa: N806
    W_OV = model.W_V @ model.W_O  # noqa: N806
    n = model.cfg.n_heads
    scores = torch.tensor([[[get_comp_score(W_OV[0, i], W_QK[1, j]),
                             get_comp_score(W_OV[0, i], W_QK[1, j].T),
                             get_comp_score(W_OV[0, i], W_OV[1, j])]
                            for j in range(n)] for i in range(n)])  # (H, H, Q/K/V)
    W_QK = FactoredMatrix(model.W_Q, model.W_K.transpose(-1, -2))  # noqa: N806
    W_OV = FactoredMatrix(model.W_V, model.W_O)  # noqa: N806
    batched = torch.stack([get_batched_comp_scores(W_OV[0], W_QK[1]),
                           get_batched_comp_scores(W_OV[0], W_QK[1].T),
                           get_batched_comp_scores(W_OV[0], W_OV[1])], dim=-1)
    return scores, batched


def test_arena_composition_scores_from_weights_and_factored_matrices(sides):
    (ours, ours_batched), (theirs, theirs_batched) = on_both(sides, composition_scores)
    assert_equal(ours, theirs)
    assert_equal(ours_batched, theirs_batched)
    assert_equal(ours_batched, ours)  # ARENA's own check: the two ways agree


def full_circuits(side):
    model, FactoredMatrix = side.model, side.FactoredMatrix  # noqa: N806
    layer, head_index = 1, 2
    W_O, W_V = model.W_O[layer, head_index], model.W_V[layer, head_index]  # noqa: N806
    full_OV_circuit = model.W_E @ FactoredMatrix(W_V, W_O) @ model.W_U  # noqa: N806 (ARENA's)

    def find_K_comp_full_circuit(model, prev_token_head_index, ind_head_index):  # noqa: N802
        W_E = model.W_E  # noqa: N806 (ARENA, solutions.py)
        W_Q, W_K = model.W_Q[1, ind_head_index], model.W_K[1, ind_head_index]  # noqa: N806
        W_O = model.W_O[0, prev_token_head_index]  # noqa: N806
        W_V = model.W_V[0, prev_token_head_index]  # noqa: N806
        Q = W_E @ W_Q  # noqa: N806
        K = W_E @ W_V @ W_O @ W_K  # noqa: N806
        return FactoredMatrix(Q, K.T)

    k_comp = find_K_comp_full_circuit(model, 1, 2)
    return full_OV_circuit.AB, full_OV_circuit.norm(), k_comp.AB, k_comp.S


def test_arena_full_circuits_as_factored_matrices(sides):
    ours, theirs = on_both(sides, full_circuits)
    assert ours[0].shape == (257, 257)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


# --- ARENA: decompose_qk_input and ablation_induction_score (hook.ctx) ------------------------

def decomposed_qk(side):
    model = side.model
    _, rep_cache = model.run_with_cache(side.rep_tokens(), remove_batch_dim=True)

    def decompose_qk_input(cache):  # ARENA, solutions.py
        y0 = cache["embed"].unsqueeze(0)
        y1 = cache["pos_embed"].unsqueeze(0)
        y_rest = cache["result", 0].transpose(0, 1)
        return torch.concat([y0, y1, y_rest], dim=0)

    decomposed = decompose_qk_input(rep_cache)
    query = torch.einsum("nsd,dh->nsh", decomposed, model.W_Q[1, 2])  # ARENA's decompose_q
    return decomposed, query, rep_cache["resid_pre", 1] - model.b_O[0]


def test_arena_decompose_qk_input(sides):
    (ours, ours_q, ours_resid), (theirs, theirs_q, _) = on_both(sides, decomposed_qk)
    assert_equal(ours, theirs)
    assert_equal(ours_q, theirs_q)
    # learned positions join the stream: the parts sum to resid_pre 1 less layer 0's b_O
    torch.testing.assert_close(ours.sum(0), ours_resid, atol=1e-5, rtol=0)


def ablation_induction_scores(side):
    model, utils, seq_len, tokens = side.model, side.utils, side.seq_len, side.rep_tokens()

    def ablation_induction_score(prev_head_index, ind_head_index):  # ARENA, solutions.py
        def ablation_hook(v, hook):
            if prev_head_index is not None:
                v[:, :, prev_head_index] = 0.0
            return v

        def induction_pattern_hook(attn, hook):
            hook.ctx[prev_head_index] = attn[0, ind_head_index].diag(-(seq_len - 1)).mean()

        model.run_with_hooks(tokens, fwd_hooks=[
            (utils.get_act_name("v", 0), ablation_hook),
            (utils.get_act_name("pattern", 1), induction_pattern_hook)])
        return model.blocks[1].attn.hook_pattern.ctx[prev_head_index].item()

    return [ablation_induction_score(i, 2) for i in (None, 0, 1, 2, 3)]


def test_arena_ablation_induction_score_reads_hook_ctx(sides):
    ours, theirs = on_both(sides, ablation_induction_scores)
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= TOL
    assert len(set(ours)) > 1  # ablating layer-0 heads moves layer 1's pattern


# --- TransformerLens's tests/unit/test_patching.py ------------------------------------------

def every_head_patch(side, function):
    model = side.model
    _, clean_cache = model.run_with_cache("The cat sat")  # test_patching.py's prompts
    corrupted_tokens = model.to_tokens("The dog ran")

    def metric(logits):
        return logits[:, -1, :].sum()

    return function(model, corrupted_tokens, clean_cache, metric)


def test_get_act_patch_attn_head_all_pos_every_shape_and_values(sides):
    with torch.no_grad():
        ours = every_head_patch(sides["glassgpt"], patching.get_act_patch_attn_head_all_pos_every)
        theirs = every_head_patch(sides["transformer_lens"],
                                  lens_patching.get_act_patch_attn_head_all_pos_every)
    model = sides["glassgpt"].model
    assert ours.shape == (5, model.cfg.n_layers, model.cfg.n_heads)  # test_patching.py's shape
    assert not torch.all(ours == ours[0, 0, 0]) and torch.isfinite(ours).all()  # ... its values
    # the metric sums 257 logits (values up to ~30): float32's own rounding there is ~2e-6
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=TOL, rtol=1e-6)


# --- the same excerpts on a true induction circuit (`glassgpt demo induction`'s run) ----------

def test_arena_finds_the_demos_induction_heads_in_layer_1_as_transformer_lens_does(
        induction_sides):
    ours, theirs = on_both(induction_sides, detectors)
    assert ours == theirs
    assert ours[2] and all(head.startswith("1.") for head in ours[2]), ours[2]
    scores, lens_scores = on_both(induction_sides, induction_scores)
    assert_equal(scores, lens_scores)
    assert scores[1].max() > 0.5 and scores[0].max() < 0.3  # the second layer, by the circuit


def test_arena_ablations_on_the_demos_run_equal_transformer_lens(induction_sides):
    ours, theirs = on_both(induction_sides, ablation_scores)
    assert_equal(ours, theirs)
    ours, theirs = on_both(induction_sides, ablation_induction_scores)
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= TOL
    assert min(ours[1:]) < ours[0] - 0.05  # some previous-token head feeds head 1.2
