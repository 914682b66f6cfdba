"""A LoRA-adapted model seen through glassgpt.interp: the attention's output projection with an
unmerged adapter ("o") must give the same logits watched as unwatched, each head's share
(hook_result) holding the adapter's part too. Reading proj.weight alone skipped the adapter."""

from __future__ import annotations

import torch

from glassgpt import GPT, GPTConfig
from glassgpt.adapters.lora import add_lora
from glassgpt.adapters.settings import LoraSettings
from glassgpt.interp import run_with_cache


def adapted_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32,
                          dropout=0.0)).double().eval()
    add_lora(model, LoraSettings(rank=2, alpha=4.0, targets=("q", "o", "down")))
    with torch.no_grad():  # B starts at zero: give every adapter something to add
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return model


def test_an_o_adapter_counts_when_each_heads_result_is_watched() -> None:
    model = adapted_model()
    ids = torch.randint(40, (2, 9))
    plain = model(ids)[0]
    name = "blocks.1.attn.hook_result"
    watched, cache = run_with_cache(model, ids, [name])
    torch.testing.assert_close(watched, plain, rtol=0, atol=1e-12)
    attn = model.blocks[1].attn
    assert type(attn.proj) is not torch.nn.Linear  # the wrapped path is the one under test
    result = cache[name]  # (B, T, H, C)
    z = run_with_cache(model, ids, ["blocks.1.attn.hook_z"])[1]["blocks.1.attn.hook_z"]
    torch.testing.assert_close(result.sum(2) + attn.proj.bias, attn.proj(z.flatten(2)),
                               rtol=0, atol=1e-12)
    without = z.clone()
    without[:, :, 1] = 0  # head 1 silent: the others' shares are what is left
    torch.testing.assert_close(result[:, :, [0, 2, 3]].sum(2) + attn.proj.bias,
                               attn.proj(without.flatten(2)), rtol=0, atol=1e-12)
