"""The trainer, as a library: nanoGPT's recipe without its globals.

AdamW (glassgpt.training.optim), gradient accumulation, clipping, autocast (bf16/fp16) where the
device has it (glassgpt.machine.devices), optional `torch.compile`, DDP or FSDP
(glassgpt.training.fsdp) under torchrun, an evaluation at the start and every `eval_interval`
steps, checkpoints (at each new best, a stop and the end) that resume on exactly the same
numbers, the best weights kept beside the last, and an optional early stop.

`Trainer` runs a whole job into a run directory (see glassgpt.rundir.checkpoint) from the pieces
in glassgpt.training.steps (`train_step`, the piece a benchmark needs, is found here too).
Setting a run up (settings, data, the model) is glassgpt.training.runs.
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

import torch
from torch import Tensor

from glassgpt.config import TrainConfig
from glassgpt.data import BatchSampler, PreparedData
from glassgpt.errors import CheckpointError, GlassGPTError
from glassgpt.machine import distributed as ddp
from glassgpt.machine.devices import (
    AUTO,
    autocast_dtype,
    cpu_threads,
    resolve_device,
    timed,
    tuner_for,
)
from glassgpt.machine.memory import check_training_fits_memory
from glassgpt.model import GPT, count_parameters
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.rundir.snapshots import SnapshotWriter
from glassgpt.rundir.trainstate import TrainState, capture_rng_state, restore_rng_state
from glassgpt.rundir.weights import load_model_tensors, read_weights
from glassgpt.storage.layout import MODEL_FILE, STATE_TENSORS_FILE
from glassgpt.training import fsdp
from glassgpt.training.metrics import (
    Reporter,
    SilentReporter,
    append_metrics,
    plot_losses,
    truncate_metrics,
)
from glassgpt.training.optim import (
    load_optimizer_state,
    lr_at,
    make_optimizer,
    optimizer_state_shapes,
    set_lr,
)
from glassgpt.training.steps import estimate_loss, stop_on_sigint, train_step

EVAL_SEED_OFFSET = 1_000_003  # eval batches come from their own stream, apart from training's


class NonFiniteLossError(GlassGPTError):
    """The loss became NaN or infinite; the last good checkpoint, if any, is kept."""


class _EvaluationStoppedError(Exception):
    """A stop (Ctrl-C, SIGTERM, the caller's event) came in the middle of an evaluation."""


# --- the trainer ---------------------------------------------------------------------------

@dataclass
class TrainResult:
    iteration: int
    train_loss: float | None  # last evaluation
    val_loss: float | None
    best_val_loss: float | None  # the best evaluation of the whole run, and where it was
    best_iteration: int | None
    interrupted: bool
    early_stopped: bool
    iterations_run: int  # by this call (a resumed run started past 0)
    seconds: float
    # With cfg.target_loss: whether an evaluation reached it, at which iteration, and how many
    # seconds into this call (evaluations included).
    target_reached: bool = False
    target_iteration: int | None = None
    target_seconds: float | None = None
    # The CPU threads the last steps ran with (None on a GPU), and whether timing chose them.
    threads: int | None = None
    threads_by_timing: bool = False
    saved: bool = True  # False only when a stop came before the run's first checkpoint


class Trainer:
    """Trains `model` on `data` into `run_dir`, checkpointing at each new best and the end.

    Each evaluation that improves the val loss commits a checkpoint with the weights also as
    the run's best (best.safetensors, in the same atomic commit); one that does not writes its
    metrics line only, unless it ends the run. A stop saves where it comes; the last checkpoint
    is what `resume` continues. loss.png is drawn once, as `run` returns. Building a Trainer
    and `resume` only read: the run directory changes once `run` starts. A caller that may
    race another writer holds the run's lock around `run` (`rundir.writing`;
    glassgpt.training.lifecycle.train_run does, from its last check to the end).

    `threads` ("auto" or a count, on a CPU) is the thread count: "auto" times the first steps
    at one thread and at all cores and keeps the faster (`devices.ThreadTuner`), except in a
    resumed run, which keeps the count its checkpoint ran with; None leaves torch's setting
    alone. The count used is in the result. `stop`, when set (by a signal, or by the caller),
    saves a checkpoint and returns, as Ctrl-C does. `extra` is recorded in config.json.

    `batches`, when given, makes each split's sampler instead of `data`'s random windows:
    `batches(split, seed)` returns an object with BatchSampler's `next_batch`, `get_state`,
    `set_state` and `device` (a fine-tune on conversations draws (x, y) whose targets are -1
    outside the assistant's tokens; glassgpt.training.finetune). `more_files`, when given, is
    asked at each save for more files (name -> bytes: a fine-tune's chat template, its LoRA
    adapters), committed with the checkpoint.

    The first checkpoint of a new run (saved right after the evaluation at step 0) replaces
    whatever run was in `run_dir` before, in one commit: metrics are held in memory until then.
    """

    def __init__(self, model: GPT, cfg: TrainConfig, data: PreparedData, run_dir: str | Path,
                 reporter: Reporter | None = None, context: ddp.DistContext | None = None,
                 threads: int | str | None = None, stop: threading.Event | None = None,
                 extra: dict | None = None,
                 batches: Callable[[str, int], BatchSampler] | None = None,
                 more_files: Callable[[], dict[str, bytes]] | None = None,
                 window: int | None = None):
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.stop, self.extra = stop, extra
        self.batches, self.more_files = batches, more_files
        self.threads_setting = threads
        self.unsaved_metrics: list[dict] | None = []  # until the first commit of a new run
        self.context = context or ddp.DistContext()
        self.reporter = reporter if reporter is not None and self.context.is_main \
            else SilentReporter()
        self.device = resolve_device(cfg.device, self.context.local_rank)
        self.threads = (None if threads is None
                        else tuner_for(threads, self.device, compiled=cfg.compile))
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)
        # Tokens a training window holds: the context, unless a caller trains shorter ones
        # (a fine-tune of a model with a 40k context on conversations of a few hundred).
        self.window = window or model.config.block_size
        data.check_block_size(self.window)
        check_training_fits_memory(dataclasses.replace(model.config, block_size=self.window),
                                   cfg.batch_size, self.amp_dtype, self.device,
                                   count_parameters(model))
        if cfg.fsdp:  # sharded in place (each shard moved to the device, never the whole
            fsdp.check_can_shard(cfg, self.context)  # model), before the optimizer sees it
            self.model = fsdp.shard_model(model, self.device, self.context)
        else:
            self.model = model.to(self.device)  # the plain model: saved, evaluated
        self.optimizer = make_optimizer(self.model, cfg)
        use_scaler = self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        fast = torch.compile(self.model) if cfg.compile else self.model
        self.eval_model = fast
        self.train_model = fast if cfg.fsdp else ddp.wrap_model(fast, self.context, self.device)
        # Each rank reads its own batches and drops its own dropout masks.
        self.sampler = self._sampler("train", cfg.seed + self.context.rank)
        torch.manual_seed(cfg.seed + self.context.rank)
        self.state = TrainState()
        self.resumed = False
        self.target: tuple[int, float] | None = None  # (iteration, seconds) of target_loss
        self.stop_requested: threading.Event | None = None  # while `run` runs
        self.losses: dict[str, float] = {}  # of the last evaluation
        self.committed = False  # whether `run` has written a checkpoint (then it draws)
        self.tokens_per_step = (cfg.batch_size * self.window * cfg.grad_accum
                                * self.context.world_size)
        # Weight snapshots at log-spaced steps (cfg.snapshots; glassgpt.rundir.snapshots).
        self.snapshots = SnapshotWriter(self.run_dir, cfg.snapshots, cfg.max_iters)

    def _sampler(self, split: str, seed: int) -> BatchSampler:
        if self.batches is not None:
            return self.batches(split, seed)
        return BatchSampler(self.data.splits[split], self.window,
                            self.cfg.batch_size, seed, self.device,
                            vocab_size=self.model.config.vocab_size)

    def resume(self, weights: bool = True, run: ckpt.Run | None = None) -> None:
        """Continue from the checkpoint in run_dir: optimizer, step, RNG and sampler states,
        and the weights unless the model already holds them (`weights=False`).

        Everything is checked before the optimizer sees it (see optim.load_optimizer_state).
        """
        run = run or ckpt.Run(self.run_dir)  # a caller that opened the run already passes it
        state = run.train_state(optimizer_state_shapes(self.optimizer))
        if weights:
            self._load_weights(run.paths[MODEL_FILE])
        saved = fsdp.shard_optimizer_state(self.optimizer, state.optimizer) if self.cfg.fsdp \
            else state.optimizer
        load_optimizer_state(self.optimizer, saved, self.run_dir / STATE_TENSORS_FILE)
        if self.threads_setting == AUTO and state.threads and self.device.type == "cpu":
            self.threads = tuner_for(state.threads, self.device)  # the count it ran with
        if self.scaler is not None and state.scaler:
            self.scaler.load_state_dict(state.scaler)
        if len(state.rng) == self.context.world_size:
            sampler_state = restore_rng_state(state.rng[self.context.rank])
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
        self.unsaved_metrics = None  # metrics.jsonl is the run's already

    def _load_weights(self, path: Path) -> None:
        tensors = read_weights(path, self.model.config)  # names and shapes checked
        if self.cfg.fsdp:
            fsdp.load_full_weights(self.model, tensors)
        else:
            load_model_tensors(self.model, tensors, path)

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
        start, first_iteration = time.perf_counter(), self.state.iteration
        if self.context.is_main:
            self._prepare_run_dir()
        self.reporter.start(self.cfg.max_iters, self.state.iteration)
        if self.context.is_main and self.resumed:
            self.snapshots.begin_resumed(self.state.iteration)
        try:
            with stop_on_sigint(self.stop) as stop_requested:
                self.stop_requested = stop_requested
                try:
                    result = self._train(start, first_iteration)
                except _EvaluationStoppedError:  # still under the handler: a save stays whole
                    result = self._stopped_during_evaluation(start, first_iteration)
                if self.context.is_main and self.committed:
                    self.snapshots.finish()
                self._draw(result)
                return result
        finally:
            self.reporter.stop()

    def _draw(self, result: TrainResult) -> None:
        """loss.png, drawn once as the run returns (drawing at every evaluation cost a third
        of a second each, more than a commit): the picture of the run as it was saved."""
        if self.context.is_main and result.saved and self.committed:
            plot_losses(self.run_dir)

    def _train(self, start: float, first_iteration: int) -> TrainResult:
        cfg, stop_requested = self.cfg, self.stop_requested
        first_bad = torch.full((), -1, device=self.device)  # first step with a non-finite loss
        if not self.resumed:  # where training starts from, as nanoGPT does;
            if self.threads is not None:  # at the count the first step takes (one thread until
                self.threads.before_step()  # timed): all cores on a busy one cost 30 s here
            ends = self._evaluate_and_save(0, start, done=False)  # saved: the run exists now
            if self.context.is_main:  # a replaced run's snapshots go with it
                self.snapshots.begin_new_run()
            self._snapshot(0)
            if ends is not None:  # the target met before any step
                return self._result(start, first_iteration)
        last_log, logged_at = time.perf_counter(), self.state.iteration
        while self.state.iteration < cfg.max_iters:
            it = self.state.iteration
            lr = lr_at(it, cfg)
            set_lr(self.optimizer, lr)
            loss = self._step()
            first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss), it + 1, first_bad)
            self.state.iteration = it = it + 1
            done = it == cfg.max_iters
            if self.snapshots.due(it):
                self._check_finite(first_bad)  # never a snapshot of NaN weights
                self._snapshot(it)
            if it % cfg.log_interval == 0 or done:
                self._check_finite(first_bad)
                elapsed = time.perf_counter() - last_log
                self._log(it, loss, lr, (it - logged_at) * self.tokens_per_step / elapsed)
                last_log, logged_at = time.perf_counter(), it
            if it % cfg.eval_interval == 0 or done:
                self._check_finite(first_bad)
                ends = self._evaluate_and_save(it, start, done)
                if ends is not None:
                    return self._result(start, first_iteration, stopped=ends == "early stop")
            if self._should_stop(stop_requested.is_set(), it, done):
                self._check_finite(first_bad)
                self._save(best=False)
                return self._result(start, first_iteration, interrupted=True)
        return self._result(start, first_iteration)

    def _step(self) -> Tensor:
        """One optimizer step, timed for the thread tuner on a CPU (where a step's host time is
        its real time: nothing runs asynchronously)."""
        with timed(self.threads):
            return train_step(self.train_model, self.optimizer, self.sampler.next_batch,
                              self.cfg, self.scaler, self.amp_dtype)

    def _snapshot(self, it: int) -> None:
        """The weights at step `it`, when it is one of the snapshots' steps (under FSDP
        gathered from every rank's shards; rank 0 writes them)."""
        if not self.snapshots.due(it):
            return
        weights = fsdp.full_weights(self.model) if self.cfg.fsdp else None
        if self.context.is_main:
            self.snapshots.save(self.model, it, weights)

    def _meets_target(self) -> bool:
        """With `target_loss`, whether the last evaluation's val loss is at or below it (every
        rank sees the same averaged losses, so all stop together)."""
        target = self.cfg.target_loss
        return target is not None and self.losses["val"] <= target

    def _no_longer_improving(self, it: int) -> bool:
        """With `early_stop` N, whether N evaluations in a row found no better val loss."""
        best = self.state.best_iteration
        if not self.cfg.early_stop or best is None:
            return False
        return (it - best) // self.cfg.eval_interval >= self.cfg.early_stop

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

    def _stopped_during_evaluation(self, start: float, first_iteration: int) -> TrainResult:
        """A stop cut an evaluation short: the weights of this iteration are saved, as at any
        other stop, except before a new run's first commit (its evaluation at step 0), which
        saves nothing: a run replaced with `force` stays whole."""
        saved = self.unsaved_metrics is None
        if saved:
            self._save(best=False)
        return self._result(start, first_iteration, interrupted=True, saved=saved)

    def _evaluation_stopped(self) -> bool:
        """Whether a stop was asked for, after each evaluation batch (ranks agree on it)."""
        requested = self.stop_requested is not None and self.stop_requested.is_set()
        if not self.context.enabled:
            return requested
        flag = torch.tensor(int(requested), device=self.device)
        return bool(ddp.max_over_ranks(flag, self.context).item())

    def _check_finite(self, first_bad: Tensor) -> None:
        bad = int(ddp.max_over_ranks(first_bad, self.context).item())
        if bad >= 0:
            raise NonFiniteLossError(f"the loss became NaN or infinite at iteration {bad}; "
                                     f"stopped without saving, {self._kept()} (try a lower "
                                     f"learning rate)")

    def _kept(self) -> str:
        """What a failed run leaves: its last checkpoint, or nothing before the first."""
        if self.unsaved_metrics is not None:
            return f"nothing was written (the run had no checkpoint yet in {self.run_dir})"
        return f"the last good checkpoint in {self.run_dir} is kept"

    def _log(self, it: int, loss: Tensor, lr: float, tokens_per_s: float) -> None:
        loss_value = ddp.mean_over_ranks(loss, self.context).item()
        record = {"iter": it, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_s}
        if self.context.is_main:
            self._append_metrics(record)
        self.reporter.log(record)

    def _evaluate(self, it: int) -> dict[str, float]:
        """Train and val loss (averaged over ranks), logged in metrics.jsonl and loss.png."""
        seed = self.cfg.seed + EVAL_SEED_OFFSET + self.context.rank
        samplers = {split: self._sampler(split, seed) for split in ("train", "val")}
        losses = estimate_loss(self.eval_model, samplers, self.cfg.eval_iters, self.amp_dtype,
                               self._evaluation_stopped)
        if losses is None:
            raise _EvaluationStoppedError
        values = {split: ddp.mean_over_ranks(v, self.context).item() for split, v in
                  losses.items()}
        if not all(math.isfinite(v) for v in values.values()):
            # At step 0 no step has run: the model's own settings give the NaN, not the lr.
            cause = ("the freshly initialised model's settings cannot work (rope_theta, "
                     "norm_eps, ...?)" if it == 0 and not self.resumed else
                     "try a lower learning rate")
            raise NonFiniteLossError(f"the evaluation at iteration {it} gave a NaN or infinite "
                                     f"loss ({values}); stopped without saving, "
                                     f"{self._kept()} ({cause})")
        record = {"iter": it, "train_loss": values["train"], "val_loss": values["val"]}
        if self.context.is_main:
            self._append_metrics(record)
        self.reporter.eval(record)
        return values

    def _evaluate_and_save(self, it: int, start: float, done: bool) -> str | None:
        """Evaluate, and commit where something changed: a new best (its weights are kept),
        the evaluation that ends the run, or a new run's first. Any other evaluation writes
        only its metrics line, so a crash loses at most the steps since the last commit (the
        last new best); a stop (Ctrl-C, SIGTERM) still saves where it came. Returns why the
        run ends here ("target", "early stop", "done"), or None."""
        self.losses = values = self._evaluate(it)
        improved = values["val"] < self.state.best_val_loss
        if improved:
            self.state.best_val_loss, self.state.best_iteration = values["val"], it
        ends = ("target" if self._meets_target() else "done" if done else
                "early stop" if self._no_longer_improving(it) else None)
        # Every rank decides alike (the losses are averaged over ranks): saving is collective.
        # A new run's first evaluation is always a new best, so it commits: the run exists.
        if improved or ends is not None:
            self._save(best=improved)
        if ends == "target":
            self.target = (it, time.perf_counter() - start)
        return ends

    def _append_metrics(self, record: dict) -> None:
        if self.unsaved_metrics is not None:
            self.unsaved_metrics.append(record)
        else:
            append_metrics(self.run_dir, record)

    def _save(self, best: bool) -> None:
        """Rank 0 writes the checkpoint (and, with `best`, the best weights in the same commit),
        with the RNG states of every rank."""
        rng = ddp.gather_objects(capture_rng_state(self.sampler.get_state()), self.context)
        weights, optimizer_state = self._whole_state()
        if self.context.is_main:
            self.state.optimizer = optimizer_state
            self.state.rng = rng
            self.state.scaler = self.scaler.state_dict() if self.scaler is not None else None
            self.state.threads = torch.get_num_threads() if self.device.type == "cpu" else None
            new_metrics = (None if self.unsaved_metrics is None else
                           "".join(json.dumps(r) + "\n" for r in self.unsaved_metrics))
            ckpt.save_checkpoint(self.run_dir, self.model, self.data.tokenizer,
                                 self.cfg.to_dict(), str(self.data.dir.resolve()), self.state,
                                 best=best, extra=self.extra, new_metrics=new_metrics,
                                 weights=weights,
                                 more_files=self.more_files() if self.more_files else None)
            self.unsaved_metrics = None
        self.committed = True
        ddp.barrier(self.context)

    def _whole_state(self) -> tuple[dict[str, Tensor] | None, dict | None]:
        """The weights (None: the model's own) and the optimizer state to save, whole: under
        FSDP gathered from every rank's shards (each rank takes part), and on rank 0 only."""
        if self.cfg.fsdp:
            return (fsdp.full_weights(self.model),
                    fsdp.full_optimizer_state(self.optimizer, self.context))
        return None, self.optimizer.state_dict() if self.context.is_main else None

    def _result(self, start: float, first_iteration: int, interrupted: bool = False,
                stopped: bool = False, saved: bool = True) -> TrainResult:
        best, losses = self.state.best_val_loss, self.losses
        target_iteration, target_seconds = self.target or (None, None)
        return TrainResult(self.state.iteration, losses.get("train"), losses.get("val"),
                           best if math.isfinite(best) else None, self.state.best_iteration,
                           interrupted, stopped, self.state.iteration - first_iteration,
                           time.perf_counter() - start, self.target is not None,
                           target_iteration, target_seconds, self._threads_used(),
                           self.threads is not None and self.threads.probes > 0, saved)

    def describe_threads(self) -> str:
        """For a start line: the CPU's fixed count, or how auto will choose ("" on a GPU)."""
        if self.device.type != "cpu":
            return ""
        return self.threads.describe() if self.threads is not None else cpu_threads()

    def _threads_used(self) -> int | None:
        return torch.get_num_threads() if self.device.type == "cpu" else None
