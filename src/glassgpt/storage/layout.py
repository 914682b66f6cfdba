"""The files of the two kinds of directory glassgpt writes, named in one place.

A run directory (`glassgpt train`, `convert`):
    config.json               model config, training config, data directory, tokenizer kind
    model.safetensors         weights of the last checkpoint (what --resume continues)
    best.safetensors          weights of the evaluation with the lowest val loss
    tokenizer.json            the tokenizer the model was trained with
    chat_template.json        an imported instruct model's chat template (only those runs)
    train_state.safetensors   optimizer tensors and RNG states          } only for runs that
    train_state.json          iteration, best val loss, the rest        } can be resumed
    metrics.jsonl, loss.png   what the trainer logged, and its picture
    snapshots/                weights at log-spaced steps (`train --snapshots N`): step_<8
                              digits>.safetensors and index.json (glassgpt.rundir.snapshots)
    timeline.json, .png       what `glassgpt timeline` measured at each snapshot, drawn

A prepared data directory (`glassgpt prepare`):
    train.bin, val.bin        token ids (uint16 when the vocabulary fits, else uint32)
    tokenizer.json            the tokenizer that made them
    meta.json                 source, corpus sha256, tokenizer kind, vocab size, token counts

Both change through glassgpt.storage.commit: new files under `<name>.pending`, then a journal (the
commit point), then renames. `DirKind` says, per kind, which names a commit may touch.
This module imports nothing of glassgpt, so data code can name a run's files without pulling
in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- a run directory ----------------------------------------------------------------------------
CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
BEST_FILE = "best.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.json"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
RUN_JOURNAL = "checkpoint.journal"
# A LoRA fine-tune's adapters (glassgpt.adapters.lora), beside the base weights they apply to.
ADAPTER_CONFIG_FILE = "adapter.json"
ADAPTER_WEIGHTS_FILE = "adapter.safetensors"
CHECKPOINT_FILES = (CONFIG_FILE, MODEL_FILE, BEST_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE,
                    STATE_JSON_FILE, CHAT_TEMPLATE_FILE, ADAPTER_CONFIG_FILE,
                    ADAPTER_WEIGHTS_FILE)
CHECKPOINTS = ("best", "last")  # which weights of a run to load, besides a snapshot's "step:N"
SNAPSHOT_PREFIX = "step:"  # `--checkpoint step:1200`: the snapshot kept at step 1200
SNAPSHOTS_DIR = "snapshots"
SNAPSHOT_INDEX = "index.json"
TIMELINE_FILE = "timeline.json"
TIMELINE_PLOT_FILE = "timeline.png"
# Files only a run holds: `prepare` never writes beside them (its tokenizer.json would replace
# the run's, which could then no longer sample, evaluate or resume).
RUN_MARKERS = (CONFIG_FILE, MODEL_FILE, STATE_JSON_FILE, STATE_TENSORS_FILE, RUN_JOURNAL)



def snapshot_file(step: int) -> str:
    """The name of the snapshot at `step` inside SNAPSHOTS_DIR: step_00001200.safetensors."""
    return f"step_{step:08d}.safetensors"


def checkpoint_step(checkpoint: str) -> int | None:
    """The step a checkpoint selector names ("step:1200" -> 1200), None for "best" and "last";
    ValueError for anything else (a negative step, "step:x", "first")."""
    if checkpoint in CHECKPOINTS:
        return None
    digits = checkpoint.removeprefix(SNAPSHOT_PREFIX) if isinstance(checkpoint, str) else ""
    if checkpoint == digits or not digits.isdigit() or not digits.isascii():
        raise ValueError(f"checkpoint must be 'best', 'last' or 'step:N' (a snapshot's step), "
                         f"got {checkpoint!r:.80}")
    return int(digits)


# --- a prepared data directory ------------------------------------------------------------------
TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
META_FILE = "meta.json"
DATA_JOURNAL = "prepare.journal"
DATA_FILES = (TRAIN_FILE, VAL_FILE, TOKENIZER_FILE, META_FILE)
# A data directory has these; a run never does, so `train --out` naming one is a typo.
DATA_MARKERS = (META_FILE, TRAIN_FILE, VAL_FILE)

# --- both ---------------------------------------------------------------------------------------
PENDING_SUFFIX = ".pending"
LOCK_FILE = ".glassgpt.lock"


@dataclass(frozen=True)
class DirKind:
    """One kind of directory: what it is called in messages, its journal, the names a commit
    may write or remove (its own files; anything else in the directory is the user's), what a
    failed commit keeps, and which command finishes an interrupted one."""

    what: str  # "checkpoint": "the checkpoint files"
    journal: str
    files: tuple[str, ...]
    noun: str  # "a checkpoint": what one commit saves
    kept: str  # "the previous checkpoint"
    finisher: str  # "the next `train --resume`"

    @property
    def pending_files(self) -> tuple[str, ...]:
        return tuple(name + PENDING_SUFFIX for name in self.files)

    @property
    def own_files(self) -> tuple[str, ...]:
        """What replacing the directory's contents (`--force`) may remove."""
        return (*self.files, self.journal, *self.pending_files)


RUN = DirKind("checkpoint", RUN_JOURNAL, (*CHECKPOINT_FILES, METRICS_FILE, PLOT_FILE,
                                          TIMELINE_FILE, TIMELINE_PLOT_FILE),
              "a checkpoint", "the previous checkpoint", "the next `train --resume`")
DATA = DirKind("data", DATA_JOURNAL, DATA_FILES, "the prepared data", "the previous data",
               "the next `prepare --force` into it")
