"""The written-out backward pass of the frozen replacement model (glassgpt.interp.graph.backward)
held to autograd's (build.py's other path) on every kind of model it takes, and the models it
refuses sent to autograd.

`autograd_graph` builds the same graph with `knows` answering no, so each row comes from
torch.autograd over B copies of the frozen forward: the two share no arithmetic past the Prompt.
"""

from __future__ import annotations

import pytest
import torch

from glassgpt.adapters.lora import add_lora, merge_lora
from glassgpt.adapters.settings import LoraSettings
from glassgpt.config import GPTConfig
from glassgpt.interp.core.hooked import hook_points
from glassgpt.interp.graph import attribution_graph
from glassgpt.interp.graph import build as graph_build
from glassgpt.interp.graph.backward import knows
from glassgpt.interp.graph.replacement import read_prompt
from glassgpt.model import GPT
from test_graph import GPT2_LIKE, LLAMA_LIKE, transcoder

SMALL = dict(n_layer=2, n_embd=16, block_size=16, vocab_size=20)
KINDS = {
    "gpt2-layernorm-tied": GPT2_LIKE,
    "llama-rmsnorm-gqa-untied": LLAMA_LIKE,
    "qwen3-head-dim-apart": dict(SMALL, n_head=4, n_kv_head=2, head_dim=8, norm="rmsnorm",
                                 position="rope", activation="swiglu", bias=False,
                                 qk_norm=True, tie_weights=False),
    "gemma-sandwich-norms": dict(SMALL, n_head=2, n_kv_head=1, norm="rmsnorm", position="rope",
                                 activation="gelu_tanh", bias=False, post_norms=True,
                                 norm_offset=True, embed_scale=True, attn_softcap=20.0),
    "multi-query-untied-biases": dict(SMALL, n_head=4, n_kv_head=1, tie_weights=False),
    "no-norm": dict(SMALL, n_head=2, norm="none"),  # its transcoders read hook_mlp_in
}
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])


def model_of(config: dict, dtype: torch.dtype = torch.float64) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config)).to(dtype).eval()
    with torch.no_grad():  # gains and biases away from 1 and 0, so each norm's adjoint counts
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def transcoders_of(model: GPT, reads: str = "ln2.hook_normalized",
                   dtype: torch.dtype = torch.float64) -> list:
    if model.config.attn_only:
        return []
    return [transcoder(layer, model.config.n_embd, dtype=dtype, reads=reads)
            for layer in range(model.config.n_layer)]


def autograd_graph(monkeypatch, *args, **kwargs):
    """attribution_graph with the written-out pass refused: every row by autograd."""
    with monkeypatch.context() as patch:
        patch.setattr(graph_build, "knows", lambda prompt: False)
        return attribution_graph(*args, **kwargs)


def assert_same_graph(written, autograd, atol: float) -> None:
    assert torch.equal(written.active_features, autograd.active_features)
    assert written.adjacency_matrix.abs().max() > 1e-3  # edges of size, not a zero matrix
    torch.testing.assert_close(written.adjacency_matrix, autograd.adjacency_matrix, atol=atol,
                               rtol=0)


@pytest.mark.parametrize("kind", KINDS, ids=list(KINDS))
def test_the_written_backward_equals_autogradss_rows_in_float64(kind, monkeypatch) -> None:
    model = model_of(KINDS[kind])
    transcoders = transcoders_of(model, "hook_mlp_in" if kind == "no-norm" else
                                 "ln2.hook_normalized")
    assert knows(read_prompt(model, transcoders, IDS))
    written = attribution_graph(model, transcoders, IDS, batch_size=7)
    assert written.n_features > 10
    assert_same_graph(written, autograd_graph(monkeypatch, model, transcoders, IDS,
                                              batch_size=7), atol=1e-10)


@pytest.mark.parametrize("reads", ["hook_resid_mid", "hook_mlp_in"])
def test_a_transcoder_reading_before_the_norm_gets_autogradss_rows(reads, monkeypatch) -> None:
    model = model_of(GPT2_LIKE)
    transcoders = transcoders_of(model, reads)
    written = attribution_graph(model, transcoders, IDS, skip_positions=0)
    assert_same_graph(written, autograd_graph(monkeypatch, model, transcoders, IDS,
                                              skip_positions=0), atol=1e-10)


def test_an_attention_only_model_gets_autogradss_rows(monkeypatch) -> None:
    model = model_of(dict(GPT2_LIKE, attn_only=True))
    assert knows(read_prompt(model, [], IDS))
    written = attribution_graph(model, [], IDS)
    assert_same_graph(written, autograd_graph(monkeypatch, model, [], IDS), atol=1e-10)


def test_in_float32_the_written_backward_is_autogradss_within_rounding(monkeypatch) -> None:
    model = model_of(LLAMA_LIKE, torch.float32)
    transcoders = transcoders_of(model, dtype=torch.float32)
    written = attribution_graph(model, transcoders, IDS)
    assert written.adjacency_matrix.dtype == torch.float32
    assert_same_graph(written, autograd_graph(monkeypatch, model, transcoders, IDS), atol=1e-4)


def doubled_values(model: GPT) -> GPT:
    """A hook on block 0's values: a linear path the written-out pass would not see."""
    hook_points(model)["blocks.0.attn.hook_v"].register_forward_hook(
        lambda module, inputs, output: output * 2)
    return model


def with_lora(model: GPT) -> GPT:
    add_lora(model, LoraSettings(rank=2, targets=("v", "up")))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:  # the adapters: B starts at zero, make it count
                parameter.normal_(0, 0.5)
    return model


REFUSED = {
    "post-ln": lambda: model_of(dict(GPT2_LIKE, pre_ln=False)),
    "hook-attached": lambda: doubled_values(model_of(GPT2_LIKE)),
    "lora-wrapped": lambda: with_lora(model_of(GPT2_LIKE)),
}


@pytest.mark.parametrize("kind", REFUSED, ids=list(REFUSED))
def test_a_model_it_does_not_know_goes_through_autograd(kind, monkeypatch) -> None:
    model = REFUSED[kind]()
    transcoders = transcoders_of(model)
    assert not knows(read_prompt(model, transcoders, IDS))
    graph = attribution_graph(model, transcoders, IDS)
    assert_same_graph(graph, autograd_graph(monkeypatch, model, transcoders, IDS), atol=0)
    with monkeypatch.context() as patch:  # the written-out pass would have got it wrong
        patch.setattr(graph_build, "knows", lambda prompt: True)
        forced = attribution_graph(model, transcoders, IDS)
    assert (forced.adjacency_matrix - graph.adjacency_matrix).abs().max() > 1e-3


def test_a_lora_models_graph_is_its_merged_models(monkeypatch) -> None:
    model = with_lora(model_of(GPT2_LIKE))
    transcoders = transcoders_of(model)
    graph = attribution_graph(model, transcoders, IDS)
    merge_lora(model)
    assert_same_graph(graph, attribution_graph(model, transcoders, IDS), atol=1e-10)


def test_dropout_at_work_is_refused_and_eval_mode_is_known() -> None:
    model = model_of(dict(GPT2_LIKE, dropout=0.1))
    transcoders = transcoders_of(model)
    assert knows(read_prompt(model, transcoders, IDS))
    model.train()
    assert not knows(read_prompt(model, transcoders, IDS))
    model.eval()
    assert attribution_graph(model, transcoders, IDS).n_features > 10
