"""`CrossLayerTrainer`: Adam over a cross-layer transcoder's weights on a stream of every
layer's MLP inputs and outputs, saved in circuit-tracer's layout with what a resume needs.

A step is the dictionary trainer's (glassgpt.interp.sae.training.trainer): the sparsity
weight of its warm-up, the batch's loss (crosslayer_objective), backward, gradients clipped
to norm 1, Adam, SAELens's lr schedule (`scheduled_lr`). A JumpReLU CLT trains its thresholds
in log space (`log_threshold`, as llamascopium does); the saved CLT holds exp(log_threshold).

With normalize_activations, each layer's inputs x_l and targets y_l are multiplied by a_l and
b_l (sqrt(d_model) / their mean norm, estimated once) while training; the saved CLT reads and
writes raw activations: W_enc[l] * a_l, and every decoder row into layer t and b_dec[t]
divided by b_t, which computes the same features and the same reconstructions.

The directory `out` holds the CLT's files (glassgpt.interp.sae.circuit_tracer_clt) and the
trainer state (trainer_state.json, trainer_state.safetensors: the weights as trained, Adam's
moments, the step, the counters, the scale and the data position), replaced whole at each
save. A resumed run continues bit for bit as if it had not stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.interp.sae.circuit_tracer_clt import clt_file_bytes
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.crosslayer_metrics import CrossLayerMetrics
from glassgpt.interp.sae.training.activations import ActivationSource
from glassgpt.interp.sae.training.crosslayer_objective import crosslayer_step
from glassgpt.interp.sae.training.crosslayer_settings import CrossLayerSettings
from glassgpt.interp.sae.training.state import (
    FLOATS,
    STATE_JSON,
    STATE_TENSORS,
    Expected,
    expected_of,
    read_state,
    read_state_tensors,
)
from glassgpt.interp.sae.training.trainer import (
    GRAD_CLIP,
    NORM_ESTIMATE_BATCHES,
    run_steps,
    scheduled_lr,
)
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory

Evaluate = Callable[[CrossLayerTranscoder], CrossLayerMetrics | None]


@dataclass
class CrossLayerResult:
    clt: CrossLayerTranscoder  # as saved (raw activations, exp of the thresholds)
    out: Path
    step: int
    interrupted: bool
    metrics: CrossLayerMetrics | None  # the last report's
    seconds: float


class CrossLayerTrainer:
    """Trains the CLT `settings` describe over `n_layers` layers of width `d_model` on
    `source` (next_batch() -> x, y (L, N, d)) into `out` (see the module docstring)."""

    def __init__(self, settings: CrossLayerSettings, source: ActivationSource, n_layers: int,
                 d_model: int, out: str | Path, *, evaluate: Evaluate | None = None,
                 metadata: dict[str, Any] | None = None, device: str | torch.device = "cpu",
                 report: Callable[[int, dict[str, Any]], None] | None = None,
                 stop: threading.Event | None = None):
        self.settings, self.source, self.out = settings, source, Path(out)
        self.evaluate, self.report, self.stop = evaluate, report, stop
        torch.manual_seed(settings.seed)
        s, L, F = settings, n_layers, settings.d_transcoder
        self.clt = CrossLayerTranscoder(
            L, d_model, F, s.architecture, s.k, s.input_hook(), s.output_hook(),
            device=device, metadata=metadata).requires_grad_(True)
        self.log_threshold = None
        if s.architecture == "jumprelu":
            self.clt.threshold.requires_grad_(False)  # what is saved: exp(log_threshold)
            self.log_threshold = nn.Parameter(torch.full(
                (L, F), math.log(max(s.jumprelu_init_threshold, 1e-12)), device=device))
        self.optimizer = torch.optim.Adam(self.trained(), lr=s.lr,
                                          betas=(s.adam_beta1, s.adam_beta2))
        self.step = 0
        self.tokens_since_fired = torch.zeros(L, F, dtype=torch.long, device=device)
        self.scaling: Tensor | None = None  # (2, L) float64: inputs' and targets' factors
        self.metrics: CrossLayerMetrics | None = None

    def trained(self) -> list[nn.Parameter]:
        clt = self.clt
        params = [clt.W_enc, clt.b_enc, *clt.W_dec, clt.b_dec]
        return params + ([self.log_threshold] if self.log_threshold is not None else [])

    def sparsity_weight(self, step: int) -> float:
        s = self.settings
        if step < s.sparsity_warm_up_steps:
            return s.l1_coefficient * step / s.sparsity_warm_up_steps
        return s.l1_coefficient

    @property
    def dead(self) -> Tensor:
        return self.tokens_since_fired > self.settings.dead_tokens

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> CrossLayerResult:
        start, s = time.perf_counter(), self.settings
        if s.normalize_activations != "none" and self.scaling is None:
            self.scaling = estimate_layer_scaling(self.source, NORM_ESTIMATE_BATCHES).to(
                self.tokens_since_fired.device)
        interrupted = run_steps(self)
        return CrossLayerResult(self.inference_clt(), self.out, self.step, interrupted,
                                self.metrics, time.perf_counter() - start)

    def train_step(self) -> dict[str, Any]:
        s = self.settings
        x, y = self.source.next_batch()  # (L, N, d) each
        if self.scaling is not None:
            x = x * self.scaling[0, :, None, None].to(x.dtype)
            y = y * self.scaling[1, :, None, None].to(y.dtype)
        lr = scheduled_lr(s, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = crosslayer_step(self.clt, self.log_threshold, x, y, self.sparsity_weight(self.step),
                              s.tanh_stretch_coefficient, s.jumprelu_threshold_window)
        if not bool(torch.isfinite(out.loss)):
            raise CheckpointError(f"the CLT's loss became NaN or infinite at step {self.step}; "
                                  f"try a lower lr (nothing was saved for it)")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trained(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        with torch.no_grad():
            self.tokens_since_fired += x.shape[1]
            self.tokens_since_fired[out.firing > 0] = 0
            residual = (out.reconstruction - y).pow(2).sum(-1).mean(1)  # (L,)
            variance = y.var(1, unbiased=False).sum(-1).clamp(min=1e-30)  # (L,)
        return {"step": self.step, "lr": lr, "loss": float(out.loss.detach()),
                **{name: float(t) for name, t in out.terms.items()},
                "l0": float(out.firing.sum()) / x.shape[1],  # features a token, all layers
                "explained_variance": float((1 - residual / variance).mean()),
                "dead": int(self.dead.sum())}

    def evaluate_now(self) -> dict[str, Any]:
        if self.evaluate is None:
            return {}
        self.metrics = self.evaluate(self.inference_clt())
        if self.metrics is None:
            return {}
        return {f"eval_{name}": value for name, value in self.metrics.summary().items()}

    def inference_clt(self) -> CrossLayerTranscoder:
        """The CLT as it is saved: exp(log_threshold), the scale folded in (module docstring)."""
        clt = self.clt
        saved = CrossLayerTranscoder(clt.n_layers, clt.d_model, clt.d_transcoder,
                                     clt.activation, clt.k, clt.input_hook, clt.output_hook,
                                     device=clt.W_enc.device, metadata=clt.metadata)
        with torch.no_grad():
            saved.load_state_dict(clt.state_dict())
            if self.log_threshold is not None:
                saved.threshold.copy_(self.log_threshold.exp())
            if self.scaling is not None:
                a, b = self.scaling.to(clt.W_enc.dtype)
                saved.W_enc.mul_(a[:, None, None])
                for source, rows in enumerate(saved.W_dec):
                    rows.div_(b[source:][None, :, None])
                saved.b_dec.div_(b[:, None])
        return saved.requires_grad_(False)

    # --- files -------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, Tensor]:
        tensors = {f"clt.{name}": t.detach() for name, t in self.clt.state_dict().items()}
        if self.log_threshold is not None:
            tensors["log_threshold"] = self.log_threshold.detach()
        tensors |= {f"adam.{i}.{key}": value for i, state in
                    self.optimizer.state_dict()["state"].items() for key, value in state.items()}
        tensors |= {"tokens_since_fired": self.tokens_since_fired,
                    "data_state": self.source.get_state()}
        if self.settings.normalize_activations != "none":
            tensors["norm_scaling"] = self.scaling if self.scaling is not None else \
                torch.ones(2, self.clt.n_layers, dtype=torch.float64)
        return tensors

    def save(self) -> Path:
        """The CLT's files and the trainer state, replacing `out` as a whole."""
        contents = clt_file_bytes(self.inference_clt())
        state = {"written_by": "glassgpt", "kind": "cross_layer_transcoder", "step": self.step,
                 "window_tokens": 0, "settings": self.settings.to_dict()}
        tensors = {name: t.detach().cpu().contiguous()
                   for name, t in self.state_tensors().items()}
        replacing = self.out.exists() and any(self.out.iterdir())
        with staged_directory(self.out, replacing) as staging:
            for name, data in contents.items():
                files.write_bytes_atomic(staging / name, data)
            files.write_bytes_atomic(staging / STATE_TENSORS, safetensors_bytes(tensors))
            files.write_text_atomic(staging / STATE_JSON, json.dumps(state))
        return self.out

    def _expected_state(self) -> dict[str, Expected]:
        expected = expected_of({name: t for name, t in self.state_tensors().items()
                                if not name.startswith("adam.")})
        for index, param in enumerate(self.optimizer.param_groups[0]["params"]):
            expected[f"adam.{index}.step"] = ((), FLOATS)
            for key in ("exp_avg", "exp_avg_sq"):
                expected[f"adam.{index}.{key}"] = (tuple(param.shape), (param.dtype,))
        return expected

    def resume(self) -> None:
        """Continue from the trainer state in `out` (as DictionaryTrainer.resume does): the same
        settings (tokens may grow), every tensor checked before any is used."""
        state = read_clt_state(self.out)
        saved = dict(state["settings"], tokens=self.settings.tokens,
                     lr_decay_steps=self.settings.lr_decay_steps)
        if saved != self.settings.to_dict():
            changed = [k for k, v in saved.items() if self.settings.to_dict().get(k) != v]
            raise ConfigError(f"{self.out} was trained with other settings "
                              f"({', '.join(changed[:3])}); resume with the same ones")
        if state["step"] > self.settings.steps:
            raise CheckpointError(f"{self.out / STATE_JSON} says step {state['step']}, more "
                                  f"than the {self.settings.steps} steps of tokens="
                                  f"{self.settings.tokens}")
        tensors = read_state_tensors(self.out / STATE_TENSORS, self._expected_state())
        self.source.set_state(tensors["data_state"])
        with torch.no_grad():
            for name, param in self.clt.state_dict().items():
                param.copy_(tensors[f"clt.{name}"])
            if self.log_threshold is not None:
                self.log_threshold.copy_(tensors["log_threshold"])
        adam = self.optimizer.state_dict()
        adam["state"] = {}
        for name, tensor in tensors.items():
            if name.startswith("adam."):
                _, index, key = name.split(".")
                adam["state"].setdefault(int(index), {})[key] = tensor
        self.optimizer.load_state_dict(adam)
        device = self.tokens_since_fired.device
        self.tokens_since_fired = tensors["tokens_since_fired"].to(device)
        if "norm_scaling" in tensors:
            self.scaling = tensors["norm_scaling"].to(device)
        self.step = state["step"]


def read_clt_state(out: Path) -> dict[str, Any]:
    """trainer_state.json of a CLT's training in `out`, its settings CrossLayerSettings's."""
    state = read_state(out)
    if state.get("kind") != "cross_layer_transcoder":
        raise CheckpointError(f"{out / STATE_JSON} is not the state of a CLT's training")
    known = {field.name for field in dataclasses.fields(CrossLayerSettings)}
    state["settings"] = {k: v for k, v in state["settings"].items() if k in known}
    return state


@torch.no_grad()
def estimate_layer_scaling(source: ActivationSource, batches: int) -> Tensor:
    """(2, L) float64: sqrt(d) / the mean norm of each layer's inputs (row 0) and targets
    (row 1) over `batches` batches of `source`; 1 where a layer's are all zero."""
    norms = None
    for _ in range(batches):
        x, y = source.next_batch()
        batch = torch.stack([x.double().norm(dim=-1).mean(1), y.double().norm(dim=-1).mean(1)])
        norms = batch.cpu() if norms is None else norms + batch.cpu()
    mean = norms / batches
    width = torch.tensor(float(x.shape[-1]), dtype=torch.float64)
    return torch.where(mean > 0, width.sqrt() / mean.clamp(min=1e-30), torch.ones_like(mean))
