"""A hostile TransformerLens / ARENA user against issue 40's surfaces: each test here failed
before its fix (a silent wrong number, a torch error from deep inside, or a message naming
another value than the one given). TransformerLens 4.3 is the reference where it has an answer.
"""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError, InputError
from glassgpt.formats.transformer_lens import lens_state_dict
from glassgpt.formats.transformer_lens_config import lens_config_dict
from glassgpt.interp import FactoredMatrix, HookedGPT, hook_points
from glassgpt.interp.core.utils import get_act_name
from glassgpt.interp.methods.patching import generic_activation_patch, get_act_patch_resid_pre
from glassgpt.model import GPT

LLAMA = dict(norm="rmsnorm", position="rope", n_kv_head=1, activation="swiglu", bias=False)
ARENA = dict(attn_only=True, norm="none", position="shortformer")


def gpt(seed: int = 0, **overrides) -> GPT:
    """A tiny GPT, every parameter drawn (gains near 1)."""
    settings = dict(vocab_size=60, block_size=12, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**settings, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            gain = name.endswith("weight") and param.dim() == 1
            param.copy_((1.0 if gain else 0.0) + 0.2 * torch.randn_like(param))
    return model.eval()


def ids(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 60, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- TransformerLens hooks that edit their tensor in place ---------------------------------

@pytest.mark.parametrize("overrides", [{}, LLAMA, ARENA], ids=["gpt2", "llama", "arena"])
def test_a_hook_editing_in_place_is_the_same_as_one_returning_the_edit(overrides):
    # ARENA's ablations write `v[:, :, h] = 0` (and return v or nothing). Before: q, k and v
    # (views of one split) raised autograd's RuntimeError, hook_pos_embed (broadcast) raised,
    # an edit of hook_mlp_in also changed the stream it is a copy of, and an edit of a
    # RMSNorm's hook_scale was ignored.
    model = HookedGPT(gpt(**overrides))
    tokens = ids()

    def doubled_in_place(tensor, hook):
        tensor.mul_(2)

    def doubled(tensor, hook):
        return tensor * 2

    for name in hook_points(model):
        in_place = model.run_with_hooks(tokens, fwd_hooks=[(name, doubled_in_place)])
        returned = model.run_with_hooks(tokens, fwd_hooks=[(name, doubled)])
        assert torch.equal(in_place, returned), name


def test_arenas_in_place_value_ablation_runs_with_gradients():
    model = HookedGPT(gpt())
    tokens = ids()

    def ablate_head_0(v, hook):  # ARENA part 2's idiom: edit in place, return the tensor
        v[:, :, 0, :] = 0.0
        return v

    loss = model.run_with_hooks(tokens, return_type="loss",
                                fwd_hooks=[(get_act_name("v", 1), ablate_head_0)])
    loss.backward()  # gradients still flow through the edited copy
    assert model.glass.tok_emb.weight.grad is not None


# --- patching ---------------------------------------------------------------------------------

def test_a_patch_setter_that_edits_in_place_and_returns_none_still_patches():
    # Before: the setter edited a copy, returned None, and the run went on unpatched (every
    # cell the corrupted run's metric).
    model = HookedGPT(gpt())
    clean, corrupted = ids(seed=1), ids(seed=2)
    _, cache = model.run_with_cache(clean)

    def metric(logits):
        return logits[:, -1, 3].mean()

    def setter_returning_none(corrupted_act, index, clean_act):
        corrupted_act[:, index[1]] = clean_act[:, index[1]]

    expected = get_act_patch_resid_pre(model, corrupted, cache, metric)
    got = generic_activation_patch(model, corrupted, cache, metric, setter_returning_none,
                                   "resid_pre", ("layer", "pos"))
    assert torch.equal(got, expected)


# --- names and indices named as given ---------------------------------------------------------

def test_get_act_name_puts_the_split_inputs_on_the_block_as_transformer_lens():
    # TransformerLens 4.3's get_act_name("q_input", 3) is "blocks.3.hook_q_input"
    assert get_act_name("q_input", 3) == "blocks.3.hook_q_input"
    assert get_act_name("v_input", 0, "b") == "blocks.0.hook_v_input"
    assert get_act_name("k_input") == "hook_k_input"


def test_a_negative_layer_past_the_start_is_named_as_given():
    model = HookedGPT(gpt())
    _, cache = model.run_with_cache(ids())
    assert torch.equal(cache["k", -2], cache["blocks.0.attn.hook_k"])
    with pytest.raises(InputError, match="layer -3 does not exist"):
        cache["k", -3]
    with pytest.raises(InputError, match="got -5"):
        model(ids(), stop_at_layer=-5)


def test_slices_past_the_end_are_input_errors_not_index_errors():
    model = HookedGPT(gpt())
    _, cache = model.run_with_cache(ids())
    with pytest.raises(InputError, match="index 99 is out of range"):
        cache.accumulated_resid(pos_slice=99)
    with pytest.raises(InputError, match="out of range"):
        cache.apply_slice_to_batch_dim(5)
    with pytest.raises(InputError, match="out of range"):
        cache.stack_neuron_results(1, neuron_slice=[999])


def test_stacks_and_directions_of_another_width_are_refused_by_name():
    model = HookedGPT(gpt())
    _, cache = model.run_with_cache(ids())
    with pytest.raises(InputError, match="d_model = 32"):  # before: centred over 5, divided
        cache.apply_ln_to_stack(torch.randn(3, 2, 6, 5))
    with pytest.raises(InputError, match="does not fit"):
        cache.apply_ln_to_stack(torch.randn(3, 2, 4, 32))
    with pytest.raises(InputError, match="project_output_onto"):
        cache.get_full_resid_decomposition(project_output_onto=torch.randn(5))
    with pytest.raises(InputError, match="project_output_onto"):
        cache.get_neuron_results(0, project_output_onto=[1.0] * 32)


def test_loss_fn_refuses_float_ids_ids_outside_the_vocabulary_and_a_wrong_mask():
    model = HookedGPT(gpt())
    tokens = ids()
    logits = model(tokens)
    torch.testing.assert_close(model.loss_fn(logits, tokens.int()), model.loss_fn(logits, tokens))
    with pytest.raises(InputError, match="integers"):
        model.loss_fn(logits, tokens.float())
    with pytest.raises(InputError, match="token id 60 is outside"):
        model.loss_fn(logits, tokens.clamp(max=0) + 60)
    with pytest.raises(InputError, match="attention_mask"):
        model.loss_fn(logits, tokens, attention_mask=torch.ones(3))


# --- FactoredMatrix ---------------------------------------------------------------------------

def test_a_factored_row_or_column_past_the_end_is_an_error_not_an_empty_matrix():
    m = FactoredMatrix(torch.randn(4, 3), torch.randn(3, 5))
    assert torch.equal(m[-1].AB, (m.A @ m.B)[-1:])
    for index in (9, (slice(None), 5), -5):
        with pytest.raises(InputError, match="out of range"):
            m[index]
    with pytest.raises(InputError, match="does not index"):
        m[1.5]
    stacked = FactoredMatrix(torch.randn(2, 4, 3), torch.randn(2, 3, 5))
    assert len(list(stacked)) == 2  # iteration still stops at the end of the leading dim


def test_factors_and_operands_of_another_dtype_or_batch_are_refused_by_name():
    A, B = torch.randn(4, 3), torch.randn(3, 5)
    with pytest.raises(InputError, match="share a dtype"):
        FactoredMatrix(A, B.double())
    with pytest.raises(InputError, match="floating-point"):
        FactoredMatrix(A.long(), B.long())
    with pytest.raises(InputError, match="share a dtype"):
        FactoredMatrix(A, B) @ torch.randn(5, 2, dtype=torch.float64)
    stacked = FactoredMatrix(torch.randn(2, 4, 3), torch.randn(2, 3, 5))
    with pytest.raises(InputError, match="do not broadcast"):
        stacked @ torch.randn(3, 5, 4)
    with pytest.raises(InputError, match="do not broadcast"):
        torch.randn(3, 2, 4) @ stacked


# --- TransformerLens checkpoints that lie --------------------------------------------------------

def test_an_lnpre_config_with_real_gains_in_its_weights_is_refused():
    # Before: the gains were loaded and computed, where TransformerLens's LNPre ignores them.
    model = gpt()
    cfg, state = lens_config_dict(model), lens_state_dict(model)
    with pytest.raises(CheckpointError, match="blocks.0.ln1.w is not all 1"):
        HookedGPT.from_lens_checkpoint({**cfg, "normalization_type": "LNPre"}, state)
    unit = {name: (torch.ones_like(t) if name.endswith(".w") else torch.zeros_like(t))
            if ".ln" in f".{name}" and name.endswith((".w", ".b")) else t
            for name, t in state.items()}  # unit gains, zero shifts: exactly LNPre
    as_pre = HookedGPT.from_lens_checkpoint({**cfg, "normalization_type": "LNPre"}, unit)
    as_ln = HookedGPT.from_lens_checkpoint(cfg, unit)
    assert torch.equal(as_pre(ids()), as_ln(ids()))


def test_a_config_eps_of_the_wrong_type_and_a_damaged_pth_are_refused_by_name(tmp_path):
    model = gpt(**ARENA)
    cfg, state = lens_config_dict(model), lens_state_dict(model)
    with pytest.raises(ConfigError, match="eps must be a number"):
        HookedGPT.from_lens_checkpoint({**cfg, "eps": "x"}, state)
    junk = tmp_path / "model.pth"
    junk.write_bytes(b"junk" * 10)  # the weights-only unpickler raised a bare KeyError
    with pytest.raises(CheckpointError, match="not a file of tensors"):
        HookedGPT.from_lens_checkpoint(cfg, junk)


@pytest.mark.parametrize("attn_types", [["local", "global"], ["global", "sliding"], "local"])
def test_a_checkpoint_with_local_attention_layers_is_refused(attn_types):
    """attn_types was read as inert: a layer TransformerLens bands to window_size keys was
    computed as global attention, other numbers without a word."""
    model = gpt()
    cfg, state = lens_config_dict(model), lens_state_dict(model)
    with pytest.raises(ConfigError, match="attn_types=.* holds other than global layers"):
        HookedGPT.from_lens_checkpoint({**cfg, "attn_types": attn_types, "window_size": 4},
                                       state)
    both_global = {**cfg, "attn_types": ["global", "global"], "window_size": 4}
    assert torch.equal(HookedGPT.from_lens_checkpoint(both_global, state)(ids()),
                       HookedGPT(model)(ids()))


@pytest.mark.parametrize("tokenizer", ["gpt2", object()], ids=["a-name", "another-library's"])
def test_a_tokenizer_that_is_not_glassgpts_is_named(tokenizer):
    with pytest.raises(InputError, match="tokenizer must be a glassgpt tokenizer .*got "
                                         f"{type(tokenizer).__name__}"):
        HookedGPT(gpt(), tokenizer)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, "float16"])
def test_from_run_refuses_a_dtype_weights_cannot_take(trained_run, dtype):
    """int8 was a many-line load_state_dict error; a string, an AttributeError."""
    with pytest.raises(InputError, match="dtype must be a floating-point torch.dtype"):
        HookedGPT.from_run(trained_run.run, dtype=dtype)
