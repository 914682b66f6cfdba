"""`glassgpt finetune`'s LoRA flags take the target table and the defaults from LoraSettings
(glassgpt.adapters.settings), which imports without torch, so `--help` still answers at once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from glassgpt.adapters.settings import DEFAULT_TARGETS, TARGETS, LoraSettings
from glassgpt.cli import build_parser
from glassgpt.cli.finetune import lora_settings


def finetune_args(*flags: str):
    return build_parser().parse_args(["finetune", "run", "--out", "tuned", *flags])


def test_the_flags_defaults_are_lora_settings_own() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(LoraSettings)}
    args = finetune_args()
    assert args.lora_dropout == defaults["dropout"]
    assert tuple(args.lora_targets.split(",")) == defaults["targets"] == DEFAULT_TARGETS
    assert lora_settings(finetune_args("--lora-rank", "8")) == LoraSettings(rank=8)
    every = finetune_args("--lora-rank", "2", "--lora-targets", ",".join(TARGETS))
    assert lora_settings(every).targets == TARGETS


def test_the_settings_and_finetune_help_import_no_torch() -> None:
    probe = ("import sys\nfrom glassgpt.adapters.settings import LoraSettings\n"
             "LoraSettings(rank=4)\nfrom glassgpt.cli import main\n"
             "try:\n    main(['finetune', '--help'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"
