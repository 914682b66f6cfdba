"""The GPT language model: embeddings, a stack of blocks, a final LayerNorm and a tied LM head.

Notation: B = batch, T = positions, C = n_embd, V = vocab_size, L = n_layer.
The model knows nothing of training or sampling: it maps token ids to logits (and a loss when
given targets). Sampling is `glassgpt.generate`; the fast decoding paths (threaded one-row
products, compiled and CUDA-graph steps) are `glassgpt.decoding`, which runs this model unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.attention import KVCache
from glassgpt.block import TransformerBlock
from glassgpt.config import GPTConfig
from glassgpt.errors import InputError

INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.proj.weight", "ffn.proj.weight")


def check_token_ids(idx: Tensor, vocab_size: int) -> None:
    """Raise InputError naming the first id of idx outside [0, vocab_size) (reads ids back)."""
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise InputError(f"token ids must be integers, got dtype {idx.dtype}")
    if idx.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(idx))
    if low < 0 or high >= vocab_size:
        raise InputError(f"token id {low if low < 0 else high} is outside the vocabulary "
                         f"[0, {vocab_size})")


def check_targets(targets: Tensor, idx: Tensor, vocab_size: int, check_ids: bool) -> None:
    """Targets are next-token ids shaped like idx, or -1 where no loss is wanted."""
    if targets.shape != idx.shape:
        raise InputError(f"targets must have the shape of the token ids {tuple(idx.shape)}, "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or \
            targets.dtype == torch.bool:
        raise InputError(f"targets must be integers, got dtype {targets.dtype}")
    if check_ids and targets.numel():
        low, high = (int(v) for v in torch.aminmax(targets))
        if low < -1 or high >= vocab_size:
            raise InputError(f"target {low if low < -1 else high} is outside the vocabulary "
                             f"[0, {vocab_size}) (or -1 to skip a position)")


def count_parameters(module: nn.Module) -> int:
    """Trainable parameters of `module`, each counted once (a tied weight is one tensor)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class GPT(nn.Module):
    """A GPT-2 style decoder-only Transformer."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        self.pos_emb = nn.Embedding(config.block_size, C)
        self.drop = nn.Dropout(config.dropout)
        # A fresh block per layer: `[block] * L` would make every layer the same module.
        self.blocks = nn.ModuleList(self._make_block() for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(C, eps=config.ln_eps, bias=config.bias)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_weights:
            # One matrix both reads tokens in and scores them on the way out.
            self.lm_head.weight = self.tok_emb.weight
        # Slicing a stored range is cheaper per decoding step than building a new arange.
        self.register_buffer("positions", torch.arange(config.block_size), persistent=False)
        self._init_gpt2_weights()

    def _make_block(self) -> TransformerBlock:
        c = self.config
        return TransformerBlock(c.n_embd, c.n_head, pre_ln=c.pre_ln, dropout=c.dropout,
                                activation=c.activation, bias=c.bias, attn_impl=c.attn_impl,
                                ln_eps=c.ln_eps)

    def _init_gpt2_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), zero biases, residual projections scaled down.

        Each block adds two outputs to the residual stream, so their variance would grow with
        depth; scaling those projections by 1/sqrt(2L) keeps the stream's scale steady.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith(RESIDUAL_PROJECTIONS):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    def check_tokens(self, idx: Tensor, start_pos: int = 0, check_ids: bool = True) -> None:
        """Raise InputError for a sequence past `block_size` or, with `check_ids`, an id outside
        the vocabulary.

        Reading the ids back is a host sync on a GPU, so the trainer and the decoders check ids
        once where they enter (the batch sampler, the prompt) and pass check_ids=False.
        """
        if idx.dim() != 2:
            raise InputError(f"token ids must be (batch, time), got shape {tuple(idx.shape)}")
        end = start_pos + idx.shape[1]
        if end > self.config.block_size:
            raise InputError(f"sequence of {end} tokens is longer than block_size="
                             f"{self.config.block_size}")
        if check_ids:
            check_token_ids(idx, self.config.vocab_size)

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        """Token ids (B, T) at positions (T,) -> the residual stream's start (B, T, C)."""
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def forward(self, idx: Tensor, targets: Tensor | None = None, *,
                pad_mask: Tensor | None = None, start_pos: int | None = None,
                last_only: bool = False, check_ids: bool = True) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) -> (logits (B, T, V), loss or None).

        targets (B, T): next-token ids, -1 where no loss is wanted.
        start_pos: idx holds positions start_pos.. and the KV cache holds the ones before.
        last_only: compute logits for the last position only (B, 1, V), which is all that
        sampling needs and saves the largest matmul of the model.
        check_ids: check every id against the vocabulary first (a host sync on a GPU; callers
        that checked their ids where they entered pass False).
        """
        offset = 0 if start_pos is None else start_pos
        self.check_tokens(idx, offset, check_ids)
        x = self.embed(idx, self.positions[offset:offset + idx.shape[1]])  # (B, T, C)
        for block in self.blocks:
            x = block(x, pad_mask=pad_mask, start_pos=start_pos)
        x = self.ln_f(x)
        if targets is None:
            logits = self.lm_head(x[:, -1:] if last_only else x)  # (B, 1 or T, V)
            return logits, None
        check_targets(targets, idx, self.config.vocab_size, check_ids)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def attention_maps(self, idx: Tensor) -> list[Tensor]:
        """Attention weights of every layer for idx (B, T): a list of L tensors (B, H, T, T).

        Runs in eval mode (no dropout), whatever mode the model is in, then restores that mode.
        """
        self.check_tokens(idx)
        was_training = self.training
        self.eval()
        x = self.embed(idx, self.positions[:idx.shape[1]])  # (B, T, C)
        maps = []
        for block in self.blocks:
            x, weights = block(x, return_attn=True)
            maps.append(weights)
        self.train(was_training)
        return maps

    # --- incremental decoding -------------------------------------------------------------

    def setup_kv_cache(self, batch_size: int, max_len: int | None = None) -> None:
        """Give every attention layer a preallocated cache for `max_len` positions."""
        c = self.config
        max_len = c.block_size if max_len is None else min(max_len, c.block_size)
        weight = self.lm_head.weight
        for block in self.blocks:
            block.attn.kv_cache = KVCache(batch_size, c.n_head, max_len, c.head_dim,
                                          dtype=weight.dtype, device=weight.device)

    def remove_kv_cache(self) -> None:
        for block in self.blocks:
            block.attn.kv_cache = None


class TransformerLM(GPT):
    """The same GPT, built from sizes instead of a config."""

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, max_len: int,
                 dropout: float = 0.0, activation: str = "gelu_tanh", pre_ln: bool = True,
                 bias: bool = True, tie_weights: bool = True):
        super().__init__(GPTConfig(vocab_size=vocab_size, block_size=max_len, n_layer=n_layers,
                                   n_head=n_heads, n_embd=d_model, dropout=dropout, bias=bias,
                                   activation=activation, pre_ln=pre_ln, tie_weights=tie_weights))
