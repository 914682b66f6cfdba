"""The GPT language model: embeddings, a stack of blocks, a final norm and a tied LM head.

Notation: B = batch, T = positions, C = n_embd, V = vocab_size, L = n_layer, H = n_head.
The stack runs in one loop, `GPT.layers`, which yields the residual stream after the embeddings
and after every block; `forward`, `attention_maps`, the logit lens and the decoding engines all
iterate it, and `GPT.read_out` turns a stream into logits. The final norm is the blocks' own kind
(LayerNorm, or RMSNorm with `norm="rmsnorm"`); each block is built from the config passed whole.
The checks of the ids and targets a caller passes live in `glassgpt.inputs`.
The model knows nothing of training or sampling: it maps token ids to logits (and a loss when
given targets). Sampling is `glassgpt.decoding.generate`; the fast decoding paths (threaded one-row
products, compiled and CUDA-graph steps) are `glassgpt.decoding`, which runs this model unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.attention import KVCache, soft_cap
from glassgpt.block import TransformerBlock
from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError, InputError
from glassgpt.hooks import add_hook_points, name_hook_points, recorded
from glassgpt.inputs import check_id_tensor, check_targets, check_token_ids, float_dtype
from glassgpt.norms import make_norm

INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.proj.weight", "ffn.proj.weight")


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run the block in eval mode (no dropout), then give `model` back the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def count_parameters(module: nn.Module) -> int:
    """Trainable parameters of `module`, each counted once (a tied weight is one tensor)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def parameter_count(config: GPTConfig) -> int:
    """Parameters of a GPT of `config`, counted without allocating it (what the memory checks
    of `glassgpt.machine.memory` are given). Every switch counts itself: the model is built
    on the meta device, which holds shapes but no values."""
    try:
        with torch.device("meta"):  # one and two layers give the cost of a layer
            one, two = (count_parameters(GPT(config.with_layers(n))) for n in (1, 2))
    except RuntimeError as error:  # sizes whose product overflows
        raise ConfigError(f"n_embd={config.n_embd}, vocab_size={config.vocab_size}, block_size="
                          f"{config.block_size} make tensors too large to exist "
                          f"({error})") from None
    return one + (config.n_layer - 1) * (two - one)


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) over the positions whose
    target is not -1. With no such position the loss is 0 (and its gradient zero), not the
    NaN of a mean over nothing."""
    losses = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                             ignore_index=-1, reduction="sum")
    counted = (targets != -1).sum().clamp(min=1)
    return losses / counted


class GPT(nn.Module):
    """A GPT-2 style decoder-only Transformer (and, by its config's switches, a Llama-style one).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ConfigError(f"GPT takes a GPTConfig, got {type(config).__name__} "
                              f"(GPTConfig.from_dict builds one from a dict)")
        self.config = config
        C = config.n_embd
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        # Rotary positions act inside attention and "none" uses none: a learned table is added
        # to the stream, a shortformer one to the attention's query and key inputs only.
        tabled = config.position in ("learned", "shortformer")
        self.pos_emb = nn.Embedding(config.block_size, C) if tabled else None
        self.drop = nn.Dropout(config.dropout)
        # A fresh block per layer: `[block] * L` would make every layer the same module.
        self.blocks = nn.ModuleList(TransformerBlock.from_config(config, layer=i)
                                    for i in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_weights:
            # One matrix both reads tokens in and scores them on the way out.
            self.lm_head.weight = self.tok_emb.weight
        # Slicing a stored range is cheaper per decoding step than building a new arange.
        self.register_buffer("positions", torch.arange(config.block_size), persistent=False)
        add_hook_points(self, "hook_embed")
        if self.pos_emb is not None:
            add_hook_points(self, "hook_pos_embed")
        self._init_gpt2_weights()
        name_hook_points(self)  # "blocks.0.attn.hook_q", ...: TransformerLens's names

    def _init_gpt2_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), zero biases, residual projections scaled down.

        Each block adds two outputs to the residual stream, so their variance would grow with
        depth; scaling those projections by 1/sqrt(2L) keeps the stream's scale steady.
        `zero_init_proj` starts them at zero instead: every block begins as the identity and
        learns how much to add (a speedrun rung).
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
                if self.config.zero_init_proj:
                    nn.init.zeros_(param)
                else:
                    nn.init.normal_(param, mean=0.0, std=residual_std)

    def check_tokens(self, idx: Tensor, start_pos: int = 0, check_ids: bool = True) -> None:
        """Raise InputError for a sequence past `block_size` or, with `check_ids`, an id outside
        the vocabulary.

        Reading the ids back is a host sync on a GPU, so the trainer and the decoders check ids
        once where they enter (the batch sampler, the prompt) and pass check_ids=False.
        """
        check_id_tensor(idx)
        if idx.dim() != 2 or 0 in idx.shape:
            raise InputError(f"token ids must be (batch, time) with at least one sequence of "
                             f"one token, got shape {tuple(idx.shape)}")
        end = start_pos + idx.shape[1]
        if end > self.config.block_size:
            raise InputError(f"sequence of {end} tokens is longer than block_size="
                             f"{self.config.block_size}")
        if check_ids:
            check_token_ids(idx, self.config.vocab_size)

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        """Token ids (B, T) at positions (T,) -> the residual stream's start (B, T, C).

        Only learned positions are added here; rotary ones act inside attention. With
        `embed_scale` (Gemma) the token vectors are multiplied by sqrt(C), a factor rounded to
        the weights' dtype as Gemma's is (bf16 makes sqrt(640) 25.25)."""
        x = self.tok_emb(idx)  # (B, T, C)
        if self.config.embed_scale:
            x = x * torch.tensor(math.sqrt(self.config.n_embd), dtype=x.dtype)
        x = self.hook_embed(x)
        if self.config.position == "learned":
            x = x + self.hook_pos_embed(self.pos_emb(positions).expand_as(x))  # (T, C) per row
        return self.drop(x)

    def shortformer_positions(self, positions: Tensor, x: Tensor) -> dict[str, Tensor]:
        """With shortformer positions, {"qk_pos": (B, T, C)}: the position embeddings every
        block's attention adds to its query and key inputs (none reach the stream); else {}."""
        if self.config.position != "shortformer":
            return {}
        return {"qk_pos": self.hook_pos_embed(self.pos_emb(positions).expand_as(x))}

    def layers(self, idx: Tensor, *, start_pos: int | None = None,
               pad_mask: Tensor | None = None,
               check_ids: bool = True) -> Iterator[tuple[int, Tensor]]:
        """The forward pass, one layer at a time: yields (depth, x) L + 1 times.

        depth 0 is the embeddings' output; depth l is the residual stream x (B, T, C) after
        block l. Every reader of the stack iterates this one loop.
        start_pos: idx holds positions start_pos.. and the KV cache holds the ones before.
        check_ids: check every id against the vocabulary (a host sync on a GPU).
        A cache, a patch or a head switched off attach to the hook points (glassgpt.interp).
        """
        offset = 0 if start_pos is None else start_pos
        self.check_tokens(idx, offset, check_ids)
        positions = self.positions[offset:offset + idx.shape[1]]  # (T,)
        x = self.embed(idx, positions)  # (B, T, C)
        extra = self.shortformer_positions(positions, x)
        yield 0, x
        for depth, block in enumerate(self.blocks, start=1):
            x = block(x, pad_mask=pad_mask, start_pos=start_pos, **extra)
            yield depth, x

    def read_out(self, x: Tensor) -> Tensor:
        """Residual stream x (..., C) -> logits (..., V): the final norm, the LM head and, with
        `logit_softcap`, cap * tanh(logits / cap), which keeps every logit within +-cap."""
        return soft_cap(self.lm_head(self.ln_f(x)), self.config.logit_softcap)

    def last_stream(self, idx: Tensor, *, start_pos: int | None = None,
                    pad_mask: Tensor | None = None, check_ids: bool = True) -> Tensor:
        """idx (B, T) -> the residual stream after the last block (B, T, C), before the final
        norm: `layers` run to its end (the arguments are its own)."""
        for _, stream in self.layers(idx, start_pos=start_pos, pad_mask=pad_mask,
                                     check_ids=check_ids):
            x = stream
        return x

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
        x = self.last_stream(idx, start_pos=start_pos, pad_mask=pad_mask, check_ids=check_ids)
        if targets is None:
            return self.read_out(x[:, -1:] if last_only else x), None  # (B, 1 or T, V)
        check_targets(targets, idx, self.config.vocab_size, check_ids)
        logits = self.read_out(x)  # (B, T, V)
        return logits, next_token_loss(logits, targets)

    @torch.no_grad()
    def attention_maps(self, idx: Tensor) -> list[Tensor]:
        """Attention weights of every layer for idx (B, T): a list of L tensors (B, H, T, T).

        Runs in eval mode (no dropout), whatever mode the model is in, then restores that mode.
        """
        patterns = [block.attn.hook_pattern for block in self.blocks]
        with eval_mode(self), recorded(*patterns) as weights:
            for _ in self.layers(idx):  # the stack only: the LM head has no part in them
                pass
        return weights  # L x (B, H, T, T): the hook points' tensors, in the order they ran

    # --- incremental decoding -------------------------------------------------------------

    def setup_kv_cache(self, batch_size: int, max_len: int | None = None) -> None:
        """Give every attention layer a preallocated cache for `max_len` positions, holding its
        n_kv_head key/value heads (grouped heads shrink it by n_head / n_kv_head)."""
        block_size = self.config.block_size
        max_len = block_size if max_len is None else min(max_len, block_size)
        dtype, device = float_dtype(self.lm_head), next(self.lm_head.parameters()).device
        for block in self.blocks:
            attn = block.attn
            attn.kv_cache = KVCache(batch_size, attn.n_kv_head, max_len, attn.head_dim,
                                    dtype=dtype, device=device)

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
