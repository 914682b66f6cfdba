"""The pieces of a training loop: one optimizer step, a loss estimate, and a stop on a signal.

`train_step` is the piece a benchmark needs; `estimate_loss` is the trainer's evaluation (a
number of random batches per split, where glassgpt.training.evaluate scores a whole split);
`stop_on_sigint` turns Ctrl-C and SIGTERM into a request the trainer acts on between batches.
glassgpt.training.trainer runs them into a run directory.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from glassgpt.config import TrainConfig
from glassgpt.data import BatchSampler
from glassgpt.inputs import check_targets
from glassgpt.machine import distributed as ddp
from glassgpt.machine.devices import autocast
from glassgpt.model import eval_mode

Batch = tuple[Tensor, Tensor]


def recompute_blocks(model: nn.Module) -> None:
    """Each block's activations recomputed in the backward instead of kept (torch's activation
    checkpointing, applied from outside the model: its blocks' forward wrapped): a second
    forward of each block for the memory of all but its input."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        def forward(*args, _inner=block.forward, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
        block.forward = forward


LOSS_CHUNK_BYTES = 2**24  # of float32 logits at once under `fused_loss` (16 MiB)


def fused_loss(model: nn.Module) -> None:
    """The loss and its gradient computed a chunk of positions at a time, in the forward, so
    that the logits of a large vocabulary never exist whole: 256 positions of Qwen3's 151,936
    words would otherwise keep their logits, log-softmax and gradient (0.5 GiB). The same
    numbers as `next_token_loss` of the model's logits (`LinearCrossEntropy`), each chunk's
    logits in float32 (or float64) whatever the model's dtype. Applied from outside the model, as
    `recompute_blocks` is: its forward, given targets, returns (None, loss); without targets,
    or with a logit soft-cap (whose tanh this does not differentiate), it is unchanged."""
    inner = model.forward
    if model.config.logit_softcap is not None:
        return

    def forward(idx: Tensor, targets: Tensor | None = None, **kwargs):
        if targets is None:
            return inner(idx, **kwargs)
        kwargs.pop("last_only", None)  # the loss needs every position, as forward's does
        x = model.last_stream(idx, **kwargs)  # (B, T, C)
        check_targets(targets, idx, model.config.vocab_size, kwargs.get("check_ids", True))
        normed = model.ln_f(x).flatten(0, 1)  # (B*T, C)
        total = LinearCrossEntropy.apply(normed, model.lm_head.weight, targets.flatten())
        return None, total / (targets != -1).sum().clamp(min=1)
    model.forward = forward


class LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(h @ W^T, targets) (rows whose target is -1 left out),
    with the gradients of h and W worked out chunk by chunk in the forward: the gradient of a
    row's loss in its logits is softmax - onehot(target), so d h = that @ W and d W = its
    transpose @ h. The backward only scales what the forward kept (two tensors the size of h
    and W, not of the logits)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
        # h (N, C), weight (V, C), targets (N,) -> () summed loss
        rows = max(1, LOSS_CHUNK_BYTES // (4 * weight.shape[0]))
        grad_h = torch.empty_like(h)
        exact = torch.promote_types(weight.dtype, torch.float32)  # float64 stays float64
        grad_w = (torch.zeros(weight.shape, dtype=exact, device=weight.device)
                  if ctx.needs_input_grad[1] else None)
        total = torch.zeros((), dtype=exact, device=h.device)
        for start in range(0, h.shape[0], rows):
            h_c, t_c = h[start:start + rows], targets[start:start + rows]
            logits = (h_c @ weight.T).to(exact)  # (n, V)
            kept = t_c != -1
            picked = t_c.clamp(min=0).unsqueeze(1)  # (n, 1)
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            total += ((lse - logits.gather(1, picked).squeeze(1)) * kept).sum()
            grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place: (n, V)
            grad.scatter_add_(1, picked, -torch.ones_like(picked, dtype=grad.dtype))
            grad *= kept.unsqueeze(1)
            grad_h[start:start + rows] = (grad.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                grad_w += grad.T @ h_c.to(exact)
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        weight_grad = (grad_w * grad_total).to(ctx.weight_dtype) \
            if ctx.needs_input_grad[1] else None
        return grad_h * grad_total.to(grad_h.dtype), weight_grad, None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               next_batch: Callable[[], Batch], cfg: TrainConfig,
               scaler: torch.amp.GradScaler | None = None,
               amp_dtype: torch.dtype | None = None) -> Tensor:
    """One optimizer step over `cfg.grad_accum` micro-batches; returns their mean loss.

    The loss stays on the device (no host sync): read it with `.item()` only when logging.
    Batches come with ids already checked (`BatchSampler`), so the model does not read them
    back (a sync per micro-batch on a GPU, and a break in a compiled graph).
    """
    total = None
    for micro in range(cfg.grad_accum):
        x, y = next_batch()  # (B, T), (B, T)
        # With DDP, all-reduce the gradients only once, after the last micro-batch.
        with ddp.sync_gradients(model, sync=micro == cfg.grad_accum - 1):
            with autocast(x.device, amp_dtype):
                _, loss = model(x, y, check_ids=False)
            # Each micro-batch loss is a mean over B*T tokens; dividing by the number of
            # micro-batches makes the summed gradients those of the mean over all of them.
            loss = loss / cfg.grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if cfg.grad_clip > 0:
        if scaler is not None:
            scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def estimate_loss(model: nn.Module, samplers: dict[str, BatchSampler], eval_iters: int,
                  amp_dtype: torch.dtype | None = None,
                  stopped: Callable[[], bool] | None = None) -> dict[str, Tensor] | None:
    """Mean loss over `eval_iters` batches of each split, in eval mode (no dropout).

    Returns device tensors so that ranks can average them; the model's mode is restored.
    `stopped`, asked after each batch, ends the evaluation early (a signal): None is returned.
    """
    losses = {}
    with eval_mode(model):
        for split, sampler in samplers.items():
            total = torch.zeros((), device=sampler.device)
            for _ in range(eval_iters):
                x, y = sampler.next_batch()
                with autocast(x.device, amp_dtype):
                    _, loss = model(x, y, check_ids=False)
                total += loss.float()
                if stopped is not None and stopped():
                    return None
            losses[split] = total / eval_iters
    return losses


@contextlib.contextmanager
def stop_on_sigint(requested: threading.Event | None = None) -> Iterator[threading.Event]:
    """An event set by Ctrl-C or SIGTERM (a scheduler's stop), instead of the signal cutting a
    step or a checkpoint write in half: the trainer saves and returns at the next step. A
    caller may pass its own event, to stop the same way for another reason (a closed stdout)."""
    requested = requested if requested is not None else threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: requested.set()) for sig in stop_signals}
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
