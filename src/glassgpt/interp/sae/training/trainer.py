"""`DictionaryTrainer`: Adam over a dictionary's weights on a stream of activations, saved in
SAELens's format with everything a resume needs beside it.

A step: the L1/L0 weight of its warm-up, the batch's loss (glassgpt.interp.sae.training.
objective), backward, gradients clipped to norm 1 and Adam (SAELens's recipe), then the lr of
SAELens's constant schedule with linear warm-up and decay. Each latent's tokens since it last
fired decide which are dead (for AuxK); firing counts over SAELens's window of 2,000 steps give
the density saved as sparsity.safetensors.

The directory `out` holds SAELens's files (cfg.json, sae_weights.safetensors,
sparsity.safetensors) and glassgpt's trainer state (trainer_state.json,
trainer_state.safetensors: the weights as trained, Adam's moments, the step, the counters and the
data position). Each save replaces the whole directory at once (staged beside it, renamed into
place). A resumed run continues bit for bit as if it had not stopped.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from glassgpt.errors import CheckpointError, ConfigError, InputError
from glassgpt.interp.sae import SAE, SAEConfig, SAEMetadata
from glassgpt.interp.sae.architectures import REGISTRY
from glassgpt.interp.sae.config import TRAINED_ON_RUN, TRAINED_ON_WEIGHTS
from glassgpt.interp.sae.disk import CFG_FILE, SAE_FILES, SPARSITY_FILE, WEIGHTS_FILE, read_config
from glassgpt.interp.sae.metrics import DictionaryMetrics, ReconstructionMeter, log_density
from glassgpt.interp.sae.provenance import trained_elsewhere
from glassgpt.interp.sae.training.activations import ActivationSource
from glassgpt.interp.sae.training.objective import (
    inference_tensors,
    resample_dead,
    training_step,
)
from glassgpt.interp.sae.training.settings import DictionarySettings
from glassgpt.interp.sae.training.state import (
    FLOATS,
    STATE_JSON,
    STATE_TENSORS,
    Expected,
    expected_of,
    read_state,
    read_state_tensors,
)
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.training.steps import stop_on_sigint

OWN_FILES = (*SAE_FILES, STATE_JSON, STATE_TENSORS)
FEATURE_SAMPLING_WINDOW = 2000  # steps over which firing counts gather (SAELens's default)
GRAD_CLIP = 1.0  # SAELens clips every step to this norm
# Batches whose mean activation norm sets normalize_activations's scale (SAELens reads 1,000
# batches of its buffer; the mean norm of a hook point settles long before that)
NORM_ESTIMATE_BATCHES = 8
# Evaluate(sae) -> metrics on held-out data, or None (a toy source has none).
Evaluate = Callable[[SAE], DictionaryMetrics | None]


@dataclass
class DictionaryResult:
    sae: SAE  # as trained (unfolded); SAE.load(out) gives the saved, SAELens-format one
    out: Path
    step: int
    interrupted: bool
    metrics: DictionaryMetrics | None  # the last report's
    seconds: float


class DictionaryTrainer:
    """Trains a dictionary of `settings` on `source` into `out` (see the module docstring).
    `metadata` goes into cfg.json's metadata (hook_name is set from the settings);
    `report(step, record)` receives each report; `stop` (or Ctrl-C, SIGTERM) saves and
    returns at the next step."""

    def __init__(self, settings: DictionarySettings, source: ActivationSource, d_in: int,
                 d_out: int, out: str | Path, *, evaluate: Evaluate | None = None,
                 metadata: dict[str, Any] | None = None, device: str | torch.device = "cpu",
                 report: Callable[[int, dict[str, Any]], None] | None = None,
                 stop: threading.Event | None = None):
        self.settings, self.source, self.out = settings, source, Path(out)
        self.evaluate, self.report, self.stop = evaluate, report, stop
        torch.manual_seed(settings.seed)
        self.arch = REGISTRY[settings.architecture]
        self.sae = build_sae(settings, d_in, d_out, metadata or {}).to(device)
        # a batch threshold is a moving average, not a gradient's
        trained = [p for name, p in self.sae.named_parameters()
                   if not (name == "threshold" and self.arch.batch_threshold)]
        self.optimizer = torch.optim.Adam(trained, lr=settings.lr,
                                          betas=(settings.adam_beta1, settings.adam_beta2))
        d_sae = settings.d_sae
        self.step = 0
        self.tokens_since_fired = torch.zeros(d_sae, dtype=torch.long, device=device)
        self.fired = torch.zeros(d_sae, dtype=torch.float64, device=device)
        self.window_tokens = 0
        self.batch_threshold = torch.zeros((), dtype=torch.float64, device=device)
        # (s_in, s_out) float64: what the inputs and targets are multiplied by while training
        # (normalize_activations), set before the first step
        self.scaling: Tensor | None = None
        self.metrics: DictionaryMetrics | None = None

    # --- the schedule ------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        return scheduled_lr(self.settings, step)

    def sparsity_weight(self, step: int) -> float:
        """The weight of the architecture's L1 or L0 loss at `step`, rising from 0 over
        sparsity_warm_up_steps (0 for one without such a loss)."""
        s = self.settings
        coefficient = self.arch.sparsity_coefficient
        weight = 0.0 if coefficient is None else getattr(s, coefficient)
        if step < s.sparsity_warm_up_steps:
            return weight * step / s.sparsity_warm_up_steps
        return weight

    @property
    def dead(self) -> Tensor:
        return self.tokens_since_fired > self.settings.dead_tokens

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> DictionaryResult:
        start, s = time.perf_counter(), self.settings
        if s.normalize_activations != "none" and self.scaling is None:
            self.scaling = estimate_scaling(self.source, NORM_ESTIMATE_BATCHES).to(
                self.batch_threshold.device)
        interrupted = run_steps(self)
        return DictionaryResult(self.sae, self.out, self.step, interrupted, self.metrics,
                                time.perf_counter() - start)

    def train_step(self) -> dict[str, Any]:
        s = self.settings
        x, y = self.source.next_batch()
        if self.scaling is not None:  # SAELens's normalize_activations
            # an SAE's target is its input, one tensor with one scale: scaled once
            scaled = x * float(self.scaling[0])
            x, y = scaled, scaled if y is x else y * float(self.scaling[1])
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = training_step(self.sae, s, x, y, self.sparsity_weight(self.step), self.dead,
                            self.batch_threshold)
        if not bool(torch.isfinite(out.loss)):
            raise CheckpointError(f"the dictionary's loss became NaN or infinite at step "
                                  f"{self.step}; try a lower lr (nothing was saved for it)")
        self._count_firing(out.firing, x.shape[0])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.sae.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self._resampling_now():
            self._resample(x, y, out.reconstruction)
        meter = ReconstructionMeter(s.d_sae)
        meter.add(y, out.firing, out.reconstruction)
        batch = meter.result()
        return {"step": self.step, "lr": lr, "loss": float(out.loss.detach()),
                **{name: float(t) for name, t in out.terms.items()},
                "l0": batch.l0, "explained_variance": batch.explained_variance,
                "dead": int(self.dead.sum())}

    def _resampling_now(self) -> bool:
        """Every resample_every steps of the first half of the training, for an architecture
        that reads the setting (TopK and BatchTopK have AuxK instead)."""
        every = self.settings.resample_every if "resample_every" in self.arch.settings else 0
        return bool(every) and self.step % every == 0 and 2 * self.step <= self.settings.steps

    def _resample(self, x: Tensor, y: Tensor, x_hat: Tensor) -> None:
        """The latents silent since the last resampling take new directions (objective.
        resample_dead); their Adam moments start again from zero, as Bricken et al. reset them.
        The generator is seeded by the step, so a resumed training draws the same inputs."""
        s = self.settings
        silent = self.tokens_since_fired >= s.resample_every * s.batch_tokens
        generator = torch.Generator().manual_seed((s.seed * 1_000_003 + self.step) % 2**63)
        latents = resample_dead(self.sae, s, x, y, x_hat, silent, generator)
        if latents.numel() == 0:
            return
        for name, param in self.sae.named_parameters():
            state = self.optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and name != "b_dec":  # b_dec (d_out,) is no latent's
                    if name == "W_enc":  # a latent's column of W_enc, its row or entry else
                        state[key][:, latents] = 0
                    else:
                        state[key][latents] = 0
        self.tokens_since_fired[latents] = 0

    @torch.no_grad()
    def _count_firing(self, firing: Tensor, tokens: int) -> None:
        """Add one batch of `tokens` rows, each latent firing on `firing` (d_sae,) of them."""
        if self.step % FEATURE_SAMPLING_WINDOW == 0:
            self.fired.zero_()
            self.window_tokens = 0
        self.tokens_since_fired += tokens
        self.tokens_since_fired[firing > 0] = 0
        self.fired += firing.double()
        self.window_tokens += tokens

    def evaluate_now(self) -> dict[str, Any]:
        if self.evaluate is None:
            return {}
        self.metrics = self.evaluate(self.inference_sae())
        return {f"eval_{name}": value for name, value in self.metrics.summary().items()}

    def inference_sae(self) -> SAE:
        """The dictionary as it is saved: SAELens's inference tensors and cfg."""
        sae = SAE(self.sae.cfg).to(self.sae.W_enc.device)
        with torch.no_grad():
            for name, tensor in inference_tensors(self.sae, self.settings, self.batch_threshold,
                                                  self.scaling).items():
                getattr(sae, name).copy_(tensor)
        if self.window_tokens:
            sae.log_sparsity = log_density(self.fired / self.window_tokens).float()
        return sae

    # --- files -------------------------------------------------------------------------------

    def save(self) -> Path:
        """SAELens's files and the trainer state, replacing `out` as a whole."""
        sae = self.inference_sae()
        tensors = {f"sae.{name}": t.detach() for name, t in self.sae.state_dict().items()}
        tensors |= {f"adam.{i}.{key}": value for i, state in
                    self.optimizer.state_dict()["state"].items() for key, value in state.items()}
        tensors |= self._counters()
        state = {"written_by": "glassgpt", "step": self.step, "window_tokens":
                 self.window_tokens, "settings": self.settings.to_dict()}
        replacing = self.out.exists() and any(self.out.iterdir())
        with staged_directory(self.out, replacing) as staging:
            files.write_text_atomic(staging / CFG_FILE, json.dumps(sae.cfg.to_dict()))
            files.write_bytes_atomic(staging / WEIGHTS_FILE, safetensors_bytes(
                {name: t.detach().cpu().contiguous() for name, t in sae.state_dict().items()}))
            if sae.log_sparsity is not None:
                files.write_bytes_atomic(staging / SPARSITY_FILE, safetensors_bytes(
                    {"sparsity": sae.log_sparsity.cpu().contiguous()}))
            files.write_bytes_atomic(staging / STATE_TENSORS, safetensors_bytes(
                {name: t.detach().cpu().contiguous() for name, t in tensors.items()}))
            files.write_text_atomic(staging / STATE_JSON, json.dumps(state))
        return self.out

    def _counters(self) -> dict[str, Tensor]:
        counters = {"tokens_since_fired": self.tokens_since_fired, "fired": self.fired,
                    "batch_threshold": self.batch_threshold,
                    "data_state": self.source.get_state()}
        if self.settings.normalize_activations != "none":  # estimated once, at the start
            counters["norm_scaling"] = self.scaling if self.scaling is not None \
                else torch.ones(2, dtype=torch.float64)
        return counters

    def _expected_state(self) -> dict[str, Expected]:
        """What trainer_state.safetensors holds for this trainer: its weights, Adam's step and
        moments of each trained parameter, the counters and the data position."""
        expected = expected_of({f"sae.{name}": t for name, t in self.sae.state_dict().items()})
        for index, param in enumerate(self.optimizer.param_groups[0]["params"]):
            expected[f"adam.{index}.step"] = ((), FLOATS)
            for key in ("exp_avg", "exp_avg_sq"):
                expected[f"adam.{index}.{key}"] = (tuple(param.shape), (param.dtype,))
        return expected | expected_of(self._counters())

    def resume(self) -> None:
        """Continue from the trainer state in `out`: weights as trained, Adam, step, counters
        and the data position. Settings that differ from the saved ones are refused (the
        number of tokens may grow), as is a state trained on another run's model, and every
        field and tensor of the state is checked before any is used (training.state)."""
        state = read_state(self.out)
        self._check_same_training(state)
        tensors = read_state_tensors(self.out / STATE_TENSORS, self._expected_state())
        try:  # first: a position the source refuses leaves this trainer as it was
            self.source.set_state(tensors["data_state"])
        except (RuntimeError, ValueError, TypeError) as error:
            raise CheckpointError(f"{self.out / STATE_TENSORS}: data_state is not a data "
                                  f"position this training saved ({error})") from None
        device = self.sae.W_enc.device
        with torch.no_grad():
            for name, param in self.sae.state_dict().items():
                param.copy_(tensors[f"sae.{name}"])
        adam = self.optimizer.state_dict()
        adam["state"] = {}
        for name, tensor in tensors.items():
            if name.startswith("adam."):
                _, index, key = name.split(".")
                adam["state"].setdefault(int(index), {})[key] = tensor
        self.optimizer.load_state_dict(adam)
        self.tokens_since_fired = tensors["tokens_since_fired"].to(device)
        self.fired = tensors["fired"].to(device)
        self.batch_threshold = tensors["batch_threshold"].to(device)
        if "norm_scaling" in tensors:
            self.scaling = tensors["norm_scaling"].to(device)
        self.step, self.window_tokens = state["step"], state["window_tokens"]

    def _check_same_training(self, state: dict[str, Any]) -> None:
        """The saved training is this one: the same settings, no more steps than these give,
        and the same run's model (when both record one: glassgpt.interp.sae.provenance)."""
        saved = dict(state["settings"], tokens=self.settings.tokens,
                     lr_decay_steps=self.settings.lr_decay_steps)
        if saved != self.settings.to_dict():
            changed = [k for k, v in saved.items() if self.settings.to_dict().get(k) != v]
            raise ConfigError(f"{self.out} was trained with other settings "
                              f"({', '.join(changed[:3])}); resume with the same ones")
        if state["step"] > self.settings.steps:
            raise CheckpointError(f"{self.out / STATE_JSON} says step {state['step']}, more than"
                                  f" the {self.settings.steps} steps of tokens="
                                  f"{self.settings.tokens}")
        recorded = read_config(self.out / CFG_FILE).metadata
        current = self.sae.cfg.metadata
        if current.get(TRAINED_ON_RUN) is not None and trained_elsewhere(
                recorded, current[TRAINED_ON_RUN], lambda: current.get(TRAINED_ON_WEIGHTS)):
            raise InputError(f"{self.out} was trained on the model of "
                             f"{recorded[TRAINED_ON_RUN]}, not of {current[TRAINED_ON_RUN]}: a "
                             f"resume goes on with the same run's model")


def scheduled_lr(s: Any, step: int) -> float:
    """SAELens's "constant" schedule of settings `s` (lr, steps, lr_warm_up_steps,
    lr_decay_steps): linear warm-up from lr / w, flat, then a linear decay to 0 over the last
    lr_decay_steps (the factor at the k-th of them is 1 - k / decay)."""
    factor = 1.0
    if step < s.lr_warm_up_steps:
        w = s.lr_warm_up_steps
        factor = 1 / w + (1 - 1 / w) * (step / (w - 1) if w > 1 else 1.0)
    decay_start = s.steps - s.lr_decay_steps
    if s.lr_decay_steps and step >= decay_start:
        factor = 1 - (step - decay_start) / s.lr_decay_steps
    return s.lr * factor


@torch.no_grad()
def estimate_scaling(source: ActivationSource, batches: int) -> Tensor:
    """(2,) float64: sqrt(width) / the mean norm of the inputs and of the targets over
    `batches` batches of `source` (SAELens's ActivationScaler: the mean of each batch's mean
    norm), 1 for a point whose activations are all zero."""
    norms = torch.zeros(2, dtype=torch.float64)
    for _ in range(batches):
        x, y = source.next_batch()
        norms += torch.stack([x.double().norm(dim=-1).mean(), y.double().norm(dim=-1).mean()]
                             ).cpu()
    widths = torch.tensor([x.shape[-1], y.shape[-1]], dtype=torch.float64)
    mean = norms / batches
    return torch.where(mean > 0, widths.sqrt() / mean.clamp(min=1e-30), torch.ones(2,
                       dtype=torch.float64))


def build_sae(settings: DictionarySettings, d_in: int, d_out: int,
              metadata: dict[str, Any]) -> SAE:
    """A fresh dictionary, initialised as SAELens's trainer does: decoder rows of norm
    decoder_init_norm, the encoder their transpose (a transcoder's its own), biases 0; its
    config the one it is saved with (the architecture's record says which)."""
    meta = SAEMetadata(metadata, hook_name=settings.hook)
    arch = REGISTRY[settings.architecture]
    if settings.transcoder:
        meta.hook_name_out = settings.hook_out
        cfg = SAEConfig(d_in, settings.d_sae, arch.transcoder_form, apply_b_dec_to_input=False,
                        d_out=d_out, metadata=meta)
    else:
        meta.update(arch.saved_metadata(settings.k))
        cfg = SAEConfig(d_in, settings.d_sae, metadata=meta, **arch.saved_fields(settings.k))
    sae = SAE(cfg)
    with torch.no_grad():
        sae.W_dec.mul_(settings.decoder_init_norm / sae.W_dec.norm(dim=-1, keepdim=True))
        if not settings.transcoder:
            sae.W_enc.copy_(sae.W_dec.T)
        if sae.threshold is not None:  # a batch threshold starts at 0
            sae.threshold.fill_(0 if arch.batch_threshold else settings.jumprelu_init_threshold)
    return sae


def run_steps(trainer: Any) -> bool:
    """The loop of a dictionary's trainer (DictionaryTrainer, CrossLayerTrainer): a step at a
    time to settings.steps, the metrics every eval_every steps and at the end, each step
    reported, saved every checkpoint_every steps, at the end and when a stop (Ctrl-C, or the
    trainer's `stop` event) comes. Whether it was stopped before the end."""
    s = trainer.settings
    with stop_on_sigint(trainer.stop) as stop_requested:
        while trainer.step < s.steps:
            record = trainer.train_step()
            done = trainer.step == s.steps
            if (s.eval_every and trainer.step % s.eval_every == 0) or done:
                record |= trainer.evaluate_now()
            if trainer.report is not None:
                trainer.report(trainer.step, record)
            stopping = stop_requested.is_set() and not done
            if done or stopping or (s.checkpoint_every
                                    and trainer.step % s.checkpoint_every == 0):
                trainer.save()
            if stopping:
                return True
    return False


def check_out(out: Path, force: bool, resume: bool, own: Callable[[Path], set[str]] | None = None,
              what: str = "dictionary") -> None:
    """A new training goes into a missing or empty directory; an existing one only with
    `force`, and only when glassgpt's training of a `what` wrote it (nothing else inside than
    `own(out)`'s names, default OWN_FILES). Never a link: the new directory would replace the
    user's link, not the directory it names."""
    if resume:
        return
    if out.is_symlink():
        raise CheckpointError(f"{out} is a symbolic link; give the directory it points to")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise CheckpointError(f"{out} exists; pass --force to replace the {what} there, "
                              f"or --resume to continue its training")
    owned = OWN_FILES if own is None else own(out)
    foreign = sorted(e.name for e in out.iterdir() if e.name not in owned) \
        if out.is_dir() else [out.name]
    if foreign or files.entry_kind(out / STATE_JSON) == "missing":
        raise CheckpointError(f"{out} is not a {what} glassgpt trained "
                              f"({', '.join(foreign[:3]) or 'no ' + STATE_JSON}); it is not "
                              f"replaced")
