"""The loss a chunk at a time (training.steps.fused_loss) against the model's own loss."""

from __future__ import annotations

import copy

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.model import GPT
from glassgpt.training import steps


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=50,
                       dropout=0.0, **overrides)
    return GPT(config).double()


@pytest.mark.parametrize("tie_weights", [True, False])
def test_loss_and_every_gradient_equal_the_whole_logits(monkeypatch, tie_weights: bool) -> None:
    monkeypatch.setattr(steps, "LOSS_CHUNK_BYTES", 4 * 50 * 7)  # 7 rows a chunk: 48 = 6*7+6
    whole = tiny(tie_weights=tie_weights)
    chunked = copy.deepcopy(whole)
    steps.fused_loss(chunked)
    idx, targets = torch.randint(50, (3, 16)), torch.randint(50, (3, 16))
    targets[0, :5] = -1  # positions without a loss
    targets[2, 9] = -1
    logits, expected = whole(idx, targets)
    none, loss = chunked(idx, targets)
    assert none is None
    expected.backward()
    loss.backward()
    assert abs(loss.item() - expected.item()) < 1e-12
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-12), name
    # Without targets the forward is the model's own.
    assert torch.equal(chunked(idx)[0], logits)


def test_frozen_head_gets_no_gradient_and_no_loss_is_zero() -> None:
    model = tiny()
    steps.fused_loss(model)
    model.tok_emb.weight.requires_grad_(False)
    idx = torch.randint(50, (1, 16))
    _, loss = model(idx, torch.full((1, 16), -1))
    loss.backward()
    assert loss.item() == 0.0 and model.tok_emb.weight.grad is None


def test_bf16_model_loss_is_not_rounded_to_bf16() -> None:
    model = tiny().to(torch.bfloat16)
    reference = tiny()  # float64, the same weights before rounding
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    steps.fused_loss(model)
    idx, targets = torch.randint(50, (2, 16)), torch.randint(50, (2, 16))
    _, loss = model(idx, targets)
    assert loss.dtype == torch.float32
    # The bf16 stream rounds; the loss itself carries no bf16 rounding of its own (2^-8).
    assert abs(loss.item() - reference(idx, targets)[1].item()) < 2e-2


def test_soft_capped_logits_keep_the_model_forward() -> None:
    model = tiny(logit_softcap=30.0)
    forward = model.forward
    steps.fused_loss(model)
    assert model.forward == forward
