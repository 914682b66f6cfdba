"""The training lifecycle as one library call: what `glassgpt train` does, for a notebook too.

    from glassgpt.training.lifecycle import train_run

    done = train_run("runs/tiny", train={"max_iters": 200})            # start (cpu-small)
    done = train_run("runs/tiny", resume=True, train={"max_iters": 400})  # continue it
    done = train_run("runs/tuned", init_from="runs/tiny", data="data/mine",
                     train={"max_iters": 100})                           # fine-tune it
    print(done.action, done.result.best_val_loss, done.threads)

Every input is checked (the out directory, the data, the config file, the settings, the shape
of the model, the run to start from) before the run directory changes. Then, holding the
directory's lock, the run is checked again and training starts; a run replaced with `force`
goes only when the new run commits its first checkpoint (at step 0).

Resuming takes the same settings the run was started with: a setting repeated (its preset, a
config file, a model or recipe flag) must equal the run's, and a different value is refused,
naming it; only the settings in RESUME_MAY_CHANGE (how long to train, how often to look) may
differ. A resumed run keeps the CPU thread count its checkpoint ran with, so N steps and a
resume to 2N end on the same weights as 2N steps in one go.

Fine-tuning (`init_from`) starts from the source run's recipe, with defaults for what a short
second run needs (FINETUNE_DEFAULTS): a learning rate a tenth of the source's, warm-up a tenth
of the iterations. Settings given explicitly always win.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glassgpt.config import GPTConfig, TrainConfig, load_preset
from glassgpt.data import PreparedData
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.machine import distributed as ddp
from glassgpt.machine.devices import AUTO, cpu_threads, resolve_device
from glassgpt.model import count_parameters
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.rundir import directory as rundir
from glassgpt.storage import files
from glassgpt.training import arguments, runs
from glassgpt.training.metrics import Reporter
from glassgpt.training.trainer import Trainer, TrainResult

# Settings a resumed run may change: how far to train and how it reports, not the recipe.
RESUME_MAY_CHANGE = ("max_iters", "eval_interval", "eval_iters", "log_interval", "early_stop",
                     "device", "compile", "target_loss", "fsdp", "snapshots")
DATA_DECIDES = ("vocab_size",)  # set by the tokenizer of the data, never by a setting
# Settings of the machine, not the recipe: a fine-tune does not inherit them from its source.
MACHINE_SETTINGS = ("device", "dtype", "compile", "fsdp")
FINETUNE_LR_FACTOR = 0.1  # a fine-tune's default peak lr: a tenth of its source's
FINETUNE_WARMUP_FRACTION = 0.1  # ... and warm-up over a tenth of its iterations
FINETUNE_DEFAULTS = ("lr", "min_lr", "warmup_iters", "eval_interval")


@dataclass
class TrainStart:
    """What is about to train, for a start line: given to `on_start` once the run directory is
    claimed and before the first step."""

    action: str  # "train", "fine-tune" or "resume"
    run_dir: Path
    data_dir: Path
    device: torch.device
    cfg: TrainConfig
    model: str  # "0.82M parameters, 4 layers, ..."
    preset: str | None
    threads: str  # "1 CPU thread", or how auto chooses
    first_iteration: int
    source: str | None = None  # a fine-tune's: which weights of which run
    warnings: list[str] = field(default_factory=list)
    preset_asked: bool = True  # False: `preset` is the device's, filling what was not given


@dataclass
class TrainOutcome:
    """What `train_run` did."""

    run_dir: Path
    action: str  # "train", "fine-tune", "resume", or "nothing" (the run is at max_iters)
    result: TrainResult | None  # None when nothing was trained
    start: TrainStart
    warnings: list[str] = field(default_factory=list)

    @property
    def threads(self) -> int | None:
        """The CPU threads the last steps ran with (None on a GPU or when nothing ran)."""
        return None if self.result is None else self.result.threads


def train_run(out: str | Path | None = None, *, data: str | Path | None = None,
              preset: str | None = None, config: str | Path | None = None,
              model: dict[str, Any] | None = None, train: dict[str, Any] | None = None,
              resume: bool = False, force: bool = False, init_from: str | Path | None = None,
              checkpoint: str = "best", threads: int | str | None = AUTO,
              reporter: Reporter | None = None, stop: threading.Event | None = None,
              on_start: Callable[[TrainStart], Any] | None = None,
              wording: str = "api") -> TrainOutcome:
    """Start, resume or fine-tune a run into `out` (default: a new runs/<time>).

    `model` and `train` are settings by field name (GPTConfig, TrainConfig), over a `config`
    TOML file, over `preset` (default: the device's, cpu-small on a CPU). `data` is a prepared
    data directory (default: Tiny Shakespeare, prepared once into the cache). `threads` is a
    CPU thread count, "auto", or None (torch's own). `stop`, once set, saves and returns as
    Ctrl-C does. Raises glassgpt.errors exceptions, having changed nothing, for bad input
    (every argument is checked first); their messages name arguments as Python does
    (`resume=True`), or as flags (`--resume`) with `wording="cli"`.
    """
    spell = arguments.spelling(wording)
    arguments.check_arguments(dict(out=out, data=data, preset=preset, config=config,
                                   model=model, train=train, resume=resume, force=force,
                                   init_from=init_from, checkpoint=checkpoint, threads=threads,
                                   reporter=reporter, stop=stop, on_start=on_start))
    request = TrainRequest(out, dict(train or {}), force, init_from=init_from,
                           checkpoint=checkpoint, threads=threads, reporter=reporter, stop=stop,
                           on_start=on_start, spell=spell, data=data, preset=preset,
                           config=config, model=dict(model or {}))
    return _resume(request) if resume else _start(request)


@dataclass
class TrainRequest:
    """What a run is asked to train, its arguments checked: `train_run`'s, and the part of
    `finetune_run`'s it shares (glassgpt.training.finetune.FinetuneRequest adds the rest).
    `init_from` is the run a fine-tune starts from; `spell` names a setting in messages."""

    out: str | Path | None
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig settings by name
    force: bool = False
    init_from: str | Path | None = None
    checkpoint: str = "best"
    threads: int | str | None = AUTO
    reporter: Reporter | None = None
    stop: threading.Event | None = None
    on_start: Callable[..., Any] | None = None
    spell: arguments.Spell = arguments.as_argument
    # train_run's own: the data, and where the settings come from
    data: str | Path | None = None
    preset: str | None = None
    config: str | Path | None = None
    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig settings by name


# --- a new run, or a fine-tune ------------------------------------------------------------------

def _start(request: TrainRequest) -> TrainOutcome:
    if request.out is None and ddp.launched_by_torchrun():
        raise ConfigError(f"under torchrun, name the run directory ({request.spell('out')})")
    run_dir = runs.fresh_run_dir() if request.out is None else \
        files.check_path_given(request.out, ConfigError, request.spell("out"))  # "": the cwd
    init_from = None if request.init_from is None else Path(request.init_from)
    rundir.check_out_dir(run_dir, request.force, init_from, request.spell,
                         writer=ddp.rank_from_env() == 0)
    source = ckpt.Run(init_from) if init_from is not None else None
    preset = request.preset or runs.preset_for_device(request.train.get("device", AUTO))
    if source is None:
        model_settings, cfg = runs.resolve_configs(preset, request.config, request.model,
                                                   request.train)
        check_model_settings(model_settings)
    else:
        model_settings = runs.model_overrides(request.config, request.model)
        cfg = finetune_config(source, preset, request.config, request.train)
    arguments.check_optimizer_settings(cfg, _user_train_settings(request), request.spell)
    warnings = recipe_warnings(cfg)
    device = resolve_device(cfg.device)
    extra = {"preset": None if source else preset,
             "init_from": None if init_from is None else str(Path(init_from).absolute())}
    with ddp.distributed(device.type) as context:
        data = runs.training_data(None if request.data is None else Path(request.data), context)
        if source is None:
            model = runs.build_model(model_settings, data.vocab_size, cfg.seed, cfg,
                                     context.local_rank)
        else:
            model = runs.model_for_finetuning(source, data, model_settings, request.checkpoint)
        trainer = Trainer(model, cfg, data, run_dir, request.reporter, context,
                          threads=request.threads, stop=request.stop, extra=extra)
        start = TrainStart("fine-tune" if source else "train", run_dir, data.dir,
                           trainer.device, cfg, describe_model(model),
                           None if source else preset, trainer.describe_threads(), 0,
                           _describe_source(source, request.checkpoint), warnings,
                           preset_asked=request.preset is not None)
        with _writer(run_dir, context):
            if context.is_main:
                rundir.check_still_free(run_dir, request.force, request.spell)
                _announce(request, start)
            ddp.barrier(context)
            result = trainer.run()
        # The DDP wrapper (and a sharded model) go before the process group, which they hold.
        del trainer, model
    return TrainOutcome(run_dir, start.action, result, start, warnings)


def _user_train_settings(request: TrainRequest) -> dict[str, Any]:
    return arguments.user_train_settings(request.config, request.train, runs.read_config_file)


def check_model_settings(settings: dict[str, Any]) -> None:
    """Refuse bad model settings before any data is read (the vocabulary size, which the data
    decides, stands in as 1 here)."""
    GPTConfig.from_dict({**settings, "vocab_size": settings.get("vocab_size", 1)})


def finetune_config(source: ckpt.Run, preset: str, config_file: str | Path | None,
                    train_flags: dict[str, Any]) -> TrainConfig:
    """The recipe of a fine-tune: the source run's (a converted run has none: the preset's),
    then FINETUNE_DEFAULTS where the user set nothing, then the config file and flags."""
    from_file = runs.read_config_file(config_file).get("train", {}) if config_file else {}
    user = {**from_file, **train_flags}
    base = {k: v for k, v in (source.train_settings or load_preset(preset).get("train", {}))
            .items() if k not in MACHINE_SETTINGS and k in _train_fields()}
    try:
        base_cfg = TrainConfig.from_dict(base)
    except ConfigError as error:
        raise CheckpointError(f"{source.dir}: its training settings are not valid: "
                              f"{error}") from None
    recipe = {**base, **user}
    max_iters = recipe.get("max_iters", base_cfg.max_iters)
    defaults = {"lr": base_cfg.lr * FINETUNE_LR_FACTOR,
                "min_lr": base_cfg.min_lr * FINETUNE_LR_FACTOR,
                "warmup_iters": int(max_iters * FINETUNE_WARMUP_FRACTION),
                "eval_interval": min(base_cfg.eval_interval, max_iters)}
    recipe.update({k: v for k, v in defaults.items() if k not in user})
    return TrainConfig.from_dict(recipe)


def _train_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig)}


def recipe_warnings(cfg: TrainConfig) -> list[str]:
    """Settings that are valid but almost certainly not what was meant."""
    warnings = []
    if cfg.decay_lr and cfg.warmup_iters >= cfg.max_iters:
        warnings.append(f"warmup_iters ({cfg.warmup_iters}) >= max_iters ({cfg.max_iters}): "
                        f"the whole run is warm-up and the lr never reaches its peak")
    if cfg.eval_interval > cfg.max_iters:
        warnings.append(f"eval_interval ({cfg.eval_interval}) > max_iters ({cfg.max_iters}): "
                        f"the run is evaluated (and its best weights kept) only at the start "
                        f"and the end")
    return warnings


# --- resuming -----------------------------------------------------------------------------------

def _resume(request: TrainRequest) -> TrainOutcome:
    if request.out is None:
        raise ConfigError(f"resuming needs the run directory to continue "
                          f"({request.spell('out')})")
    run_dir = files.check_path_given(request.out, ConfigError, request.spell("out"))
    if ddp.rank_from_env() == 0:  # a run in use: say so before reading it (rank 0 writes it,
        files.check_unlocked(run_dir, CheckpointError)  # and may hold its lock already)
    validated = rundir.fingerprint(run_dir)  # what is read next must be what is continued
    run = ckpt.Run(run_dir)
    cfg = resumed_config(run, request.preset, request.config, request.init_from,
                         request.model, request.train, request.spell)
    arguments.check_optimizer_settings(cfg, _user_train_settings(request), request.spell)
    files.check_can_make_dir(run_dir, CheckpointError)  # read-only: say so before the work
    rundir.check_recoverable(run_dir)
    data_dir = Path(request.data) if request.data is not None else run.data_dir
    if data_dir is None:
        raise ConfigError(f"{run_dir} records no data directory; pass "
                          f"{request.spell('data')}")
    device = resolve_device(cfg.device)
    with ddp.distributed(device.type) as context:
        data = PreparedData(data_dir)
        # The last checkpoint's weights: the ones its optimizer state belongs to.
        model = run.load_model(checkpoint="last")[0].train()
        runs.check_same_tokenizer(data, run)
        trainer = Trainer(model, cfg, data, run_dir, request.reporter, context,
                          threads=request.threads, stop=request.stop, extra=run.extra)
        trainer.resume(weights=False, run=run)
        start = TrainStart("resume", run_dir, data.dir, trainer.device, cfg,
                           describe_model(model), run.extra.get("preset"),
                           trainer.describe_threads(), trainer.state.iteration)
        if trainer.state.iteration >= cfg.max_iters:
            return TrainOutcome(run_dir, "nothing", None, start)
        with _writer(run_dir, context):
            if context.is_main:
                rundir.continue_run(run_dir, validated)
                _announce(request, start)
            ddp.barrier(context)
            result = trainer.run()
        del trainer, model  # as in train_run: what holds the process group goes before it
    return TrainOutcome(run_dir, "resume", result, start)


def resumed_config(run: ckpt.Run, preset: str | None, config_file: str | Path | None,
                   init_from: str | Path | None, model_flags: dict[str, Any],
                   train_flags: dict[str, Any],
                   spell: arguments.Spell = arguments.as_flag) -> TrainConfig:
    """The recipe to continue `run` with: its own, with the settings the user repeated checked
    against it (each must equal the run's, except RESUME_MAY_CHANGE)."""
    if not run.has_train_state():
        run.train_state()  # raises the error that explains what to do
    _check_same_start(run, preset, init_from, spell)
    saved = run.train_settings
    try:
        TrainConfig.from_dict(saved)
    except ConfigError as error:
        raise CheckpointError(f"{run.paths[ckpt.CONFIG_FILE]}: its 'train' table is not "
                              f"valid: {error}") from None
    tables = load_preset(preset) if preset else {}
    from_file = runs.read_config_file(config_file) if config_file else {}
    model = {**tables.get("model", {}), **from_file.get("model", {}), **model_flags}
    train = {**tables.get("train", {}), **from_file.get("train", {}), **train_flags}
    _check_repeated("model", model, run.model_config.to_dict(), run, spell,
                    skip=DATA_DECIDES)
    fixed = {k: v for k, v in train.items() if k not in RESUME_MAY_CHANGE}
    _check_repeated("training", fixed, TrainConfig.from_dict(saved).to_dict(), run, spell)
    return TrainConfig.from_dict({**saved, **train})


def _check_same_start(run: ckpt.Run, preset: str | None, init_from: str | Path | None,
                      spell: arguments.Spell) -> None:
    recorded = run.extra.get("preset")
    if preset is not None and preset != recorded:
        had = f"preset {recorded}" if recorded else "no preset recorded"
        raise ConfigError(f"{spell('preset', preset)} differs from the run's ({had}); a "
                          f"resumed run keeps its recipe: drop {spell('preset')}, or start a "
                          f"new run with {spell('init_from', str(run.dir))}")
    recorded_source = run.extra.get("init_from")
    if init_from is not None and not _same_path(init_from, recorded_source):
        raise ConfigError(f"{spell('init_from', str(init_from))} differs from the run's "
                          f"({recorded_source or 'it was not fine-tuned'}); a resumed run "
                          f"continues its own weights")


def _same_path(given: str | Path, recorded: str | None) -> bool:
    if recorded is None:
        return False
    with contextlib.suppress(OSError):
        return Path(given).resolve() == Path(recorded).resolve()
    return str(given) == recorded


def _check_repeated(what: str, asked: dict[str, Any], has: dict[str, Any], run: ckpt.Run,
                    spell: arguments.Spell, skip: tuple[str, ...] = ()) -> None:
    changed = {k: v for k, v in asked.items() if k not in skip and has.get(k, v) != v}
    if not changed:
        return
    described = ", ".join(f"{k}={v} (the run has {has.get(k)})"
                          for k, v in sorted(changed.items()))
    fresh = f"start a new run with {spell('init_from', str(run.dir))}"
    hint = (fresh if what == "model" else f"only {', '.join(RESUME_MAY_CHANGE[:3])} and how "
            f"it reports may change; {fresh} for another recipe")
    raise ConfigError(f"cannot change {what} settings of a run when resuming: {described}; "
                      f"{hint}")


# --- both ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _writer(run_dir: Path, context: ddp.DistContext) -> Iterator[None]:
    """Rank 0 holds the run directory's lock until training ends; other ranks write nothing
    there. A run that ends before its first commit leaves no directory it made."""
    if not context.is_main:
        yield
        return
    with rundir.writing(run_dir):
        yield


def _announce(request: TrainRequest, start: TrainStart) -> None:
    if request.on_start is not None:
        request.on_start(start)


def _describe_source(source: ckpt.Run | None, checkpoint: str) -> str | None:
    if source is None:
        return None
    return f"{source.dir} from {source.describe_weights(checkpoint)}"


def describe_model(model: torch.nn.Module) -> str:
    c = model.config
    return (f"{parameters_text(count_parameters(model))} parameters, {_plural(c.n_layer, 'layer')}"
            f", {_plural(c.n_head, 'head')}, width {c.n_embd}, context {c.block_size}")


def parameters_text(count: int) -> str:
    """0.82M, or the count itself below 100,000 (a tiny model's 4,816, not 0.00M)."""
    return f"{count / 1e6:.2f}M" if count >= 100_000 else f"{count:,}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


# --- what to tell the user ----------------------------------------------------------------------

def start_line(start: TrainStart) -> str:
    """"training preset cpu-small (0.82M parameters, ...) on cpu, 2 CPU threads, data D, run
    directory R" ("training a model of 0.82M parameters, ..." without --preset): what trains,
    where, with what, and where it goes."""
    if start.action == "resume":
        what = f"resuming at iteration {start.first_iteration} of {start.cfg.max_iters}"
    elif start.action == "fine-tune":
        what = f"fine-tuning {start.source} ({start.model})"
    elif start.preset is not None and start.preset_asked:
        what = f"training preset {start.preset} ({start.model})"
    else:  # no preset asked for: the sizes say what trains
        what = f"training a model of {start.model}"
    threads = f", {start.threads}" if start.threads else ""
    return (f"{what} on {start.device}{threads}, data {start.data_dir}, run directory "
            f"{start.run_dir}")


def summary_line(result: TrainResult, run_dir: Path) -> str:
    """"trained 2000 iterations in 96.4 s: train loss ..., val loss ...; best val loss ... at
    iteration ...; run saved in R": how the run went."""
    start = result.iteration - result.iterations_run
    span = (f"{result.iterations_run} iterations" if start == 0 else
            f"{result.iterations_run} iterations ({start} -> {result.iteration})")
    stopped = " (early stop: no better val loss lately)" if result.early_stopped else ""
    if result.target_reached and result.target_iteration == 0:
        stopped = " (target val loss already met at iteration 0, before any step)"
    elif result.target_reached:
        stopped = (f" (target val loss reached at iteration {result.target_iteration}, "
                   f"{result.target_seconds:.1f} s in)")
    best = (f"; best val loss {result.best_val_loss:.4f} at iteration {result.best_iteration}"
            if result.best_iteration is not None else "")
    if result.threads_by_timing:
        span += f" on {cpu_threads(result.threads)} (chosen by timing)"
    return (f"trained {span} in {result.seconds:.1f} s{stopped}: train loss "
            f"{result.train_loss:.4f}, val loss {result.val_loss:.4f}{best}; run saved in "
            f"{run_dir}")
