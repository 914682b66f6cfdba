"""The trainer, as a library: nanoGPT's recipe without its globals.

AdamW with weight decay on matrices only, linear warmup then cosine decay to `min_lr`, gradient
accumulation, clipping, autocast (bf16/fp16) where the device has it, optional `torch.compile`,
DDP under torchrun, periodic evaluation, and checkpoints that resume on exactly the same numbers.

`make_optimizer` and `train_step` are the pieces a benchmark needs; `Trainer` runs a whole job
into a run directory (see glassgpt.checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt import checkpoint as ckpt
from glassgpt import distributed as ddp
from glassgpt import files
from glassgpt.config import GPTConfig, check_field_types, load_preset, settings_from_dict
from glassgpt.data import BatchSampler, PreparedData
from glassgpt.errors import CheckpointError, ConfigError, DataError, GlassGPTError
from glassgpt.memory import check_model_fits_memory, check_training_fits_memory
from glassgpt.metrics import Reporter, SilentReporter, append_metrics, plot_losses, truncate_metrics
from glassgpt.model import GPT

DTYPES = ("auto", "float32", "bfloat16", "float16")
EVAL_SEED_OFFSET = 1_000_003  # eval batches come from their own stream, apart from training's


class NonFiniteLossError(GlassGPTError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with a help text (shown by `glassgpt train --help`)."""
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclass
class TrainConfig:
    """Every training setting. Defaults follow nanoGPT; presets' [train] tables override them."""

    max_iters: int = setting(5000, "optimizer steps in total (a resumed run continues to it)")
    batch_size: int = setting(12, "sequences per micro-batch, per rank")
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    lr: float = setting(6e-4, "peak learning rate")
    min_lr: float = setting(6e-5, "floor of the cosine decay")
    warmup_iters: int = setting(100, "steps of linear warmup")
    lr_decay_iters: int = setting(0, "step where the cosine decay ends (0: max_iters)")
    decay_lr: bool = setting(True, "warmup and cosine decay (else a constant lr)")
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices and embeddings")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "largest gradient norm (0: no clipping)")
    eval_interval: int = setting(250, "evaluate and checkpoint every this many steps")
    eval_iters: int = setting(20, "batches per split in an evaluation")
    log_interval: int = setting(10, "steps between progress updates and metrics lines")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = setting("auto", "autocast dtype: auto (bf16/fp16 on CUDA, float32 "
                         "elsewhere), float32, bfloat16, float16")
    compile: bool = setting(False, "torch.compile the model")
    seed: int = setting(1337, "seed of initialisation, batches and dropout")

    def __post_init__(self) -> None:
        check_field_types(self)
        check_finite_settings(self)
        for name in ("max_iters", "batch_size", "grad_accum", "eval_interval", "eval_iters",
                     "log_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "min_lr"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return settings_from_dict(cls, values, "training settings")


def check_finite_settings(settings: Any) -> None:
    """A float setting of a dataclass is finite: `--lr inf` or `--ln-eps inf` would train on
    NaN, and JSON (config.json) cannot even hold the value."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be a finite number, got {value}")


def read_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """A TOML file with optional [model] and [train] tables (the presets' layout), read with
    files.read_toml's bounds. The user named it: a link to it is followed, on purpose."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    tables = files.read_toml(path.resolve(), ConfigError)
    unknown = sorted(set(tables) - {"model", "train"})
    if unknown:
        raise ConfigError(f"{path}: unknown tables {unknown}; use [model] and [train]")
    return tables


def resolve_configs(preset: str, config_file: str | Path | None, model_flags: dict[str, Any],
                    train_flags: dict[str, Any]) -> tuple[dict[str, Any], TrainConfig]:
    """Settings in order of precedence: flags > --config file > preset > defaults."""
    tables = load_preset(preset)
    from_file = read_config_file(config_file) if config_file else {}
    model = {**tables.get("model", {}), **from_file.get("model", {}), **model_flags}
    train = {**tables.get("train", {}), **from_file.get("train", {}), **train_flags}
    return model, TrainConfig.from_dict(train)


# --- device and precision ------------------------------------------------------------------

def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but CUDA is not available here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `dtype` on `device`; None means plain float32."""
    if dtype == "auto":
        if device.type != "cuda":
            # On a CPU bf16 is opt-in: it pays off only where the CPU has bf16 instructions
            # (2.6x on shakespeare-char with AVX512-BF16, 1.2x on cpu-small: BENCHMARKS.md),
            # and full precision keeps CPU runs comparable with the documented losses.
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype == "float16" and device.type != "cuda":
        raise ConfigError(f"dtype float16 needs CUDA (it trains with a gradient scaler); "
                          f"use bfloat16 or float32 on {device.type}")
    return {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# --- optimizer and schedule ----------------------------------------------------------------

FUSED_ADAMW_DEVICES = ("cuda", "cpu", "mps")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW decaying only tensors of 2+ dims: matrices and embeddings, not biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # One fused kernel updates every parameter where the device has it; foreach elsewhere.
    fused = params[0].device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused,
                             foreach=None if fused else True)


ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")


def adamw_state_shapes(optimizer: torch.optim.Optimizer) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor AdamW keeps once it has stepped, named as a checkpoint
    names them (`optimizer.<parameter index>.<name>`): a step count and two moments each."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shapes: dict[str, tuple[int, ...]] = {}
    for index, param in enumerate(params):
        shapes[f"optimizer.{index}.step"] = ()
        shapes[f"optimizer.{index}.exp_avg"] = tuple(param.shape)
        shapes[f"optimizer.{index}.exp_avg_sq"] = tuple(param.shape)
    return shapes


def load_adamw_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                     source: Path) -> None:
    """Give `optimizer` a checkpoint's state, checked first: the fused AdamW kernel reads
    moments of the wrong shape out of bounds (a segfault), so nothing unchecked may reach it.

    Names, shapes and dtypes of the tensors were checked as the file was read (against
    `adamw_state_shapes`); here the groups must split the same parameters the same way, each
    parameter's state must be exactly AdamW's, and each step count at least 1. The
    hyperparameters are this run's settings: the checkpoint's own, unless a flag changed one.
    """
    fresh = optimizer.state_dict()["param_groups"]
    if [group.get("params") for group in saved["param_groups"]] != \
            [group["params"] for group in fresh]:
        raise CheckpointError(f"{source}: the optimizer's parameter groups do not fit the "
                              f"model")
    for index, values in saved["state"].items():
        if set(values) != set(ADAMW_STATE) or not all(isinstance(v, Tensor)
                                                      for v in values.values()):
            raise CheckpointError(f"{source}: the optimizer state of parameter {index} holds "
                                  f"{sorted(values)}; AdamW keeps {list(ADAMW_STATE)}")
        if not values["step"].item() >= 1:
            raise CheckpointError(f"{source}: optimizer.{index}.step is "
                                  f"{values['step'].item()}; a saved step count is at least 1")
    optimizer.load_state_dict({"state": saved["state"], "param_groups": fresh})


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at lr_decay_iters, then flat."""
    if not cfg.decay_lr:
        return cfg.lr
    if iteration < cfg.warmup_iters:
        return cfg.lr * (iteration + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if iteration >= decay_iters:
        return cfg.min_lr
    progress = (iteration - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


Batch = tuple[Tensor, Tensor]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               next_batch: Callable[[], Batch], cfg: TrainConfig,
               scaler: torch.amp.GradScaler | None = None,
               amp_dtype: torch.dtype | None = None) -> Tensor:
    """One optimizer step over `cfg.grad_accum` micro-batches; returns their mean loss.

    The loss stays on the device (no host sync): read it with `.item()` only when logging.
    """
    total = None
    for micro in range(cfg.grad_accum):
        x, y = next_batch()  # (B, T), (B, T)
        # With DDP, all-reduce the gradients only once, after the last micro-batch.
        with ddp.sync_gradients(model, sync=micro == cfg.grad_accum - 1):
            with autocast(x.device, amp_dtype):
                _, loss = model(x, y)
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
                  amp_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Mean loss over `eval_iters` batches of each split, in eval mode (no dropout).

    Returns device tensors so that ranks can average them; the model's mode is restored.
    """
    was_training = model.training
    model.eval()
    losses = {}
    for split, sampler in samplers.items():
        total = torch.zeros((), device=sampler.device)
        for _ in range(eval_iters):
            x, y = sampler.next_batch()
            with autocast(x.device, amp_dtype):
                _, loss = model(x, y)
            total += loss.float()
        losses[split] = total / eval_iters
    model.train(was_training)
    return losses


@contextlib.contextmanager
def stop_on_sigint() -> Iterator[threading.Event]:
    """An event set by Ctrl-C or SIGTERM (a scheduler's stop), instead of the signal cutting a
    step or a checkpoint write in half: the trainer saves and returns at the next step."""
    requested = threading.Event()
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


# --- the trainer ---------------------------------------------------------------------------

@dataclass
class TrainResult:
    iteration: int
    train_loss: float | None  # last evaluation
    val_loss: float | None
    interrupted: bool
    seconds: float


class Trainer:
    """Trains `model` on `data` into `run_dir`, checkpointing at every evaluation and the end.

    Building a Trainer and `resume` only read: the run directory changes once `run` starts. A
    caller that may race another writer holds `files.locked_directory(run_dir)` around `run`
    (the CLI does, from its last check to the end of training).
    """

    def __init__(self, model: GPT, cfg: TrainConfig, data: PreparedData, run_dir: str | Path,
                 reporter: Reporter | None = None, context: ddp.DistContext | None = None):
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.context = context or ddp.DistContext()
        self.reporter = reporter if reporter is not None and self.context.is_main \
            else SilentReporter()
        self.device = resolve_device(cfg.device, self.context.local_rank)
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)
        data.check_block_size(model.config.block_size)
        check_training_fits_memory(model.config, cfg.batch_size, self.amp_dtype, self.device)
        self.model = model.to(self.device)  # the plain model: saved, evaluated
        self.optimizer = make_optimizer(self.model, cfg)
        use_scaler = self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        fast = torch.compile(self.model) if cfg.compile else self.model
        self.eval_model = fast
        self.train_model = ddp.wrap_model(fast, self.context, self.device)
        # Each rank reads its own batches and drops its own dropout masks.
        self.sampler = self._sampler("train", cfg.seed + self.context.rank)
        torch.manual_seed(cfg.seed + self.context.rank)
        self.state = ckpt.TrainState()
        self.resumed = False
        self.tokens_per_step = (cfg.batch_size * model.config.block_size * cfg.grad_accum
                                * self.context.world_size)

    def _sampler(self, split: str, seed: int) -> BatchSampler:
        return BatchSampler(self.data.splits[split], self.model.config.block_size,
                            self.cfg.batch_size, seed, self.device)

    def resume(self, weights: bool = True) -> None:
        """Continue from the checkpoint in run_dir: optimizer, step, RNG and sampler states,
        and the weights unless the model already holds them (`weights=False`).

        Everything is checked before the optimizer sees it (see load_adamw_state).
        """
        state = ckpt.load_train_state(self.run_dir, adamw_state_shapes(self.optimizer))
        if weights:
            path = ckpt.run_paths(self.run_dir)[ckpt.MODEL_FILE]
            ckpt.load_model_tensors(self.model, ckpt.read_weights(path, self.model.config),
                                    path)
        load_adamw_state(self.optimizer, state.optimizer,
                         self.run_dir / ckpt.STATE_TENSORS_FILE)
        if self.scaler is not None and state.scaler:
            self.scaler.load_state_dict(state.scaler)
        if len(state.rng) == self.context.world_size:
            sampler_state = ckpt.restore_rng_state(state.rng[self.context.rank])
            try:
                self.sampler.set_state(sampler_state)
            except (RuntimeError, TypeError) as error:
                raise ckpt.CheckpointError(f"{self.run_dir}: the saved batch-sampler state is "
                                           f"malformed ({error})") from None
        else:  # another world size: new streams per rank, so not bitwise the same run
            torch.manual_seed(self.cfg.seed + self.context.rank + state.iteration)
            self.sampler = self._sampler("train", self.cfg.seed + self.context.rank
                                         + state.iteration)
        self.state = state
        self.resumed = True

    def _prepare_run_dir(self) -> None:
        """Create the run directory; a resumed run drops metrics logged after its checkpoint
        (they will be logged again)."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"cannot create {self.run_dir} ({error})") from None
        if self.resumed:
            truncate_metrics(self.run_dir, self.state.iteration)

    def run(self) -> TrainResult:
        cfg, start = self.cfg, time.perf_counter()
        if self.context.is_main:
            self._prepare_run_dir()
        losses: dict[str, float] = {}
        self.reporter.start(cfg.max_iters, self.state.iteration)
        first_bad = torch.full((), -1, device=self.device)  # first step with a non-finite loss
        last_log, logged_at = time.perf_counter(), self.state.iteration
        try:
            with stop_on_sigint() as stop_requested:
                while self.state.iteration < cfg.max_iters:
                    it = self.state.iteration
                    lr = lr_at(it, cfg)
                    set_lr(self.optimizer, lr)
                    loss = train_step(self.train_model, self.optimizer, self.sampler.next_batch,
                                      cfg, self.scaler, self.amp_dtype)
                    first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss),
                                            it + 1, first_bad)
                    self.state.iteration = it = it + 1
                    done = it == cfg.max_iters
                    if it % cfg.log_interval == 0 or done:
                        self._check_finite(first_bad)
                        elapsed = time.perf_counter() - last_log
                        self._log(it, loss, lr, (it - logged_at) * self.tokens_per_step / elapsed)
                        last_log, logged_at = time.perf_counter(), it
                    if it % cfg.eval_interval == 0 or done:
                        self._check_finite(first_bad)
                        losses = self._evaluate_and_save(it)
                    if self._should_stop(stop_requested.is_set(), it, done):
                        self._check_finite(first_bad)
                        self._save()
                        return self._result(losses, True, start)
        finally:
            self.reporter.stop()
        return self._result(losses, False, start)

    def _should_stop(self, requested: bool, it: int, done: bool) -> bool:
        if done:
            return False
        if not self.context.enabled:
            return requested
        # Ranks agree at log steps only: an all-reduce every step would cost a sync.
        if it % self.cfg.log_interval != 0:
            return False
        flag = torch.tensor(int(requested), device=self.device)
        return bool(ddp.max_over_ranks(flag, self.context).item())

    def _check_finite(self, first_bad: Tensor) -> None:
        bad = int(ddp.max_over_ranks(first_bad, self.context).item())
        if bad >= 0:
            raise NonFiniteLossError(f"the loss became NaN or infinite at iteration {bad}; "
                                     f"stopped without saving, the last good checkpoint in "
                                     f"{self.run_dir} is kept (try a lower --lr)")

    def _log(self, it: int, loss: Tensor, lr: float, tokens_per_s: float) -> None:
        loss_value = ddp.mean_over_ranks(loss, self.context).item()
        record = {"iter": it, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_s}
        if self.context.is_main:
            append_metrics(self.run_dir, record)
        self.reporter.log(record)

    def _evaluate_and_save(self, it: int) -> dict[str, float]:
        seed = self.cfg.seed + EVAL_SEED_OFFSET + self.context.rank
        samplers = {split: self._sampler(split, seed) for split in ("train", "val")}
        losses = estimate_loss(self.eval_model, samplers, self.cfg.eval_iters, self.amp_dtype)
        values = {split: ddp.mean_over_ranks(v, self.context).item() for split, v in
                  losses.items()}
        if not all(math.isfinite(v) for v in values.values()):  # the last step broke the weights
            raise NonFiniteLossError(f"the evaluation at iteration {it} gave a NaN or infinite "
                                     f"loss ({values}); stopped without saving, the last good "
                                     f"checkpoint in {self.run_dir} is kept (try a lower --lr)")
        self.state.best_val_loss = min(self.state.best_val_loss, values["val"])
        record = {"iter": it, "train_loss": values["train"], "val_loss": values["val"]}
        if self.context.is_main:
            append_metrics(self.run_dir, record)
            plot_losses(self.run_dir)
        self.reporter.eval(record)
        self._save()
        return values

    def _save(self) -> None:
        """Rank 0 writes the checkpoint, with the RNG states of every rank."""
        rng = ddp.gather_objects(ckpt.capture_rng_state(self.sampler.get_state()), self.context)
        if self.context.is_main:
            self.state.optimizer = self.optimizer.state_dict()
            self.state.rng = rng
            self.state.scaler = self.scaler.state_dict() if self.scaler is not None else None
            ckpt.save_checkpoint(self.run_dir, self.model, self.data.tokenizer,
                                 self.cfg.to_dict(), str(self.data.dir.resolve()), self.state)
        ddp.barrier(self.context)

    def _result(self, losses: dict[str, float], interrupted: bool, start: float) -> TrainResult:
        return TrainResult(self.state.iteration, losses.get("train"), losses.get("val"),
                           interrupted, time.perf_counter() - start)


def resume_settings(run_dir: str | Path, model_flags: dict[str, Any],
                    train_flags: dict[str, Any]) -> tuple[TrainConfig, Path | None]:
    """The training settings to continue the run in `run_dir` with, and its data directory
    (None when the run records none).

    Training settings may change (`train_flags` override the run's); model settings may not.
    """
    config = ckpt.read_run_config(run_dir)
    if not ckpt.has_train_state(run_dir):
        ckpt.load_train_state(run_dir)  # raises the error that explains what to do
    changed = {k: v for k, v in model_flags.items() if config["model"].get(k) != v}
    if changed:
        asked = ", ".join(f"{k}={v} (the run has {config['model'].get(k)})"
                          for k, v in sorted(changed.items()))
        raise ConfigError(f"cannot change model settings of a run when resuming: {asked}; "
                          f"start a new run with --init-from {run_dir}")
    saved = config["train"] or {}
    try:
        TrainConfig.from_dict(saved)
    except ConfigError as error:
        raise CheckpointError(f"{Path(run_dir) / ckpt.CONFIG_FILE}: its 'train' table is not "
                              f"valid: {error}") from None
    cfg = TrainConfig.from_dict({**saved, **train_flags})
    data_dir = config.get("data_dir")
    return cfg, None if data_dir is None else Path(data_dir)


def check_same_tokenizer(data: PreparedData, run_dir: str | Path) -> None:
    """Refuse data prepared with another tokenizer than the run's: the ids would mean nothing."""
    if data.tokenizer.to_json() != ckpt.read_tokenizer(Path(run_dir)).to_json():
        raise DataError(f"the data's tokenizer differs from the one of {run_dir}; prepare the "
                        f"text with --tokenizer-file {Path(run_dir) / ckpt.TOKENIZER_FILE}")


def model_for_finetuning(init_from: str | Path, data: PreparedData,
                         model_settings: dict[str, Any]) -> GPT:
    """The model of run `init_from`, in train mode, to train further on `data`.

    Its shape is fixed by its weights; only `dropout` among `model_settings` may differ.
    """
    model, _ = ckpt.load_model(init_from)
    check_same_tokenizer(data, init_from)
    changed = {k for k, v in model_settings.items() if k != "dropout"
               and getattr(model.config, k) != v}
    if changed:
        raise ConfigError(f"--init-from {init_from}: its model settings are fixed; only "
                          f"--dropout may change (got {sorted(changed)})")
    if "dropout" in model_settings:
        fresh = GPT(dataclasses.replace(model.config, dropout=model_settings["dropout"]))
        fresh.load_state_dict(model.state_dict())
        model = fresh
    return model.train()


def build_model(model_settings: dict[str, Any], vocab_size: int, seed: int) -> GPT:
    """A freshly initialised GPT; the vocabulary size comes from the data's tokenizer."""
    config = GPTConfig.from_dict({**model_settings, "vocab_size": vocab_size})
    check_finite_settings(config)
    check_model_fits_memory(config)
    torch.manual_seed(seed)  # the same initial weights on every rank
    return GPT(config)
