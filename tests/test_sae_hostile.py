"""Sparse dictionaries given lying files or used on the wrong run: each one clear line, nothing
written. cfg.json's metadata checked when read, a tampered trainer state refused before a
resume uses it, a dictionary trained on another run's model refused by resume, `sae eval` and
`view`, and the command `sae train` prints after Ctrl-C run as printed; the density histogram's
bars scaled to the largest count.

The dictionaries are tiny (16 latents, two steps) on the session's trained run (one layer, 16
wide); "another run" is a copy of it with nudged weights, "the run moved" a plain copy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glassgpt.cli import main
from glassgpt.errors import CheckpointError
from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.training import DictionaryTrainer
from test_sae import FIXTURES, saved_cfg
from test_sae_train import SparseToy, toy_settings

HOOK = "blocks.0.hook_resid_post"


def cli(*args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def copy_of_run(run: Path, dest: Path, nudged: bool) -> Path:
    """A copy of `run`; `nudged`: with other weights (another run of the same shape)."""
    shutil.copytree(run, dest)
    for name in ("best.safetensors", "model.safetensors") if nudged else ():
        with safe_open(dest / name, "pt") as file:
            metadata = file.metadata()
        tensors = load_file(dest / name)
        tensors["tok_emb.weight"] += 0.01
        save_file(tensors, dest / name, metadata)
    return dest


def train_args(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sae", "train", str(run), "--hook", HOOK, "--out", str(out), "--d-sae", "16",
            "--architecture", "topk", "--k", "2", "--tokens", "256", "--batch-tokens", "128",
            "--eval-every", "0", *extra]


@pytest.fixture(scope="module")
def trained_sae(trained_run, tmp_path_factory) -> Path:
    """A dictionary `glassgpt sae train` trained on the session's run (two steps)."""
    out = tmp_path_factory.mktemp("trained_sae") / "sae"
    assert main(train_args(trained_run.run, out)) == 0
    return out


@pytest.fixture(scope="module")
def other_run(trained_run, tmp_path_factory) -> Path:
    return copy_of_run(trained_run.run, tmp_path_factory.mktemp("other") / "run", nudged=True)


# --- cfg.json's metadata, checked when read -------------------------------------------------

@pytest.mark.parametrize("field, value, says", [
    ("context_size", "abc", "metadata.context_size must be a positive integer, got 'abc'"),
    ("context_size", [1], "metadata.context_size must be a positive integer, got \\[1\\]"),
    ("context_size", -5, "metadata.context_size must be a positive integer, got -5"),
    ("context_size", True, "metadata.context_size must be a positive integer"),
    ("model_name", 3, "metadata.model_name must be a name"),
    ("glassgpt_run", "", "metadata.glassgpt_run must be a name"),
])
def test_a_lying_metadata_field_is_refused_when_read(tmp_path: Path, field, value,
                                                      says) -> None:
    directory = shutil.copytree(FIXTURES / "topk", tmp_path / "sae")
    cfg = saved_cfg(directory)
    cfg["metadata"][field] = value
    (directory / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=says):
        SAE.load(directory)


def test_sae_eval_says_a_bad_context_size_in_one_line(trained_run, trained_sae, tmp_path,
                                                      capsys) -> None:
    sae = shutil.copytree(trained_sae, tmp_path / "sae")
    cfg = saved_cfg(sae)
    cfg["metadata"]["context_size"] = "abc"
    (sae / "cfg.json").write_text(json.dumps(cfg))
    code, _, err = cli("sae", "eval", sae, "--run", trained_run.run, "--tokens", "64",
                       capsys=capsys)
    assert code == 2 and "metadata.context_size" in err and err.count("\n") == 1


# --- a tampered trainer state ---------------------------------------------------------------

def tamper_tensors(out: Path, change) -> None:
    path = out / "trainer_state.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def tamper_json(out: Path, **fields) -> None:
    path = out / "trainer_state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, **fields}))


def garbage_rng(tensors: dict) -> None:
    tensors["data_state"] = torch.randint(0, 256, tensors["data_state"].shape,
                                          dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(0))


def nan_fired(tensors: dict) -> None:
    tensors["fired"][3] = float("nan")


@pytest.mark.parametrize("tamper, says", [
    (lambda out: tamper_tensors(out, lambda t: t.pop("fired")), "lacks fired"),
    (lambda out: tamper_tensors(out, lambda t: t.update({"adam.0.exp_avg": torch.zeros(3)})),
     "adam.0.exp_avg is F32 of shape \\(3,\\); this training's is float32 of shape \\(16, 64\\)"),
    (lambda out: tamper_tensors(out, garbage_rng), "data_state is not a data position"),
    (lambda out: tamper_tensors(out, lambda t: t.update(
        {"data_state": torch.zeros(7, dtype=torch.uint8)})), "data_state is U8 of shape \\(7,\\)"),
    (lambda out: tamper_tensors(out, nan_fired), "fired holds 1 NaN"),
    (lambda out: tamper_json(out, step=-5), "step must be a whole number >= 0, got -5"),
    (lambda out: tamper_json(out, step=10**15), "says step 1000000000000000, more than the 2"),
    (lambda out: tamper_json(out, step="3"), "step must be a whole number >= 0, got '3'"),
    (lambda out: tamper_json(out, window_tokens=1.5), "window_tokens must be a whole number"),
], ids=["missing", "adam-shape", "garbage-rng", "rng-size", "nan", "step-negative",
        "step-huge", "step-string", "window-float"])
def test_a_tampered_trainer_state_is_one_clear_error(tmp_path: Path, tamper, says) -> None:
    settings = toy_settings(architecture="topk", k=4, tokens=256 * 2, lr_warm_up_steps=0)
    DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "sae").run()
    tamper(tmp_path / "sae")
    with pytest.raises(CheckpointError, match=says):
        DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "sae").resume()


def test_the_command_line_refuses_a_tampered_state_in_one_line(trained_run, trained_sae,
                                                               tmp_path, capsys) -> None:
    out = shutil.copytree(trained_sae, tmp_path / "sae")
    tamper_json(out, step=-5)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = cli("sae", "train", trained_run.run, "--resume", "--out", out,
                       capsys=capsys)
    assert code == 2 and "step must be a whole number" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- a dictionary trained on another run's model --------------------------------------------

def test_a_resume_on_another_runs_model_is_refused(trained_run, trained_sae, other_run,
                                                   tmp_path, capsys) -> None:
    out = shutil.copytree(trained_sae, tmp_path / "sae")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = cli("sae", "train", other_run, "--resume", "--out", out, "--tokens", "512",
                       capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert str(trained_run.run.resolve()) in err and str(other_run.resolve()) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # model_name kept
    moved = copy_of_run(trained_run.run, tmp_path / "moved", nudged=False)  # same weights
    code, stdout, _ = cli("sae", "train", moved, "--resume", "--out", out, "--tokens", "512",
                          capsys=capsys)
    assert code == 0 and "for 4 steps" in stdout
    assert SAE.load(out).cfg.metadata.glassgpt_run == str(moved.resolve())


def test_sae_eval_refuses_a_dictionary_of_another_run_unless_told(trained_run, trained_sae,
                                                                  other_run, capsys) -> None:
    code, _, err = cli("sae", "eval", trained_sae, "--run", other_run, "--tokens", "64",
                       capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "--any-run" in err
    assert str(trained_run.run.resolve()) in err and str(other_run.resolve()) in err
    code, stdout, _ = cli("sae", "eval", trained_sae, "--run", other_run, "--tokens", "64",
                          "--json", "--any-run", capsys=capsys)
    assert code == 0 and json.loads(stdout)["l0"] >= 0


def test_the_view_refuses_a_dictionary_of_another_run_unless_told(trained_sae, other_run,
                                                                  capsys) -> None:
    # Past every check the command stops only at the address it cannot listen on.
    view = ["view", other_run, "--host", "256.0.0.1", "--sae", trained_sae]
    code, _, err = cli(*view, capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "--any-run" in err
    code, _, err = cli(*view, "--any-run", capsys=capsys)
    assert code == 2 and "cannot listen on 256.0.0.1" in err


def test_steering_along_a_latent_of_another_runs_dictionary_is_refused_unless_told(
        trained_run, trained_sae, other_run, capsys) -> None:
    steer = ["sample", other_run, "--prompt", "To", "--max-new-tokens", "2", "--steer",
             f"{trained_sae}:0", "--scale", "1"]
    code, out, err = cli(*steer, capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "--any-run" in err and not out
    assert str(trained_run.run.resolve()) in err and str(other_run.resolve()) in err
    code, _, err = cli(*steer, "--any-run", capsys=capsys)
    assert code == 0 and f"steering: 1 x {trained_sae}:0" in err
    code, _, _ = cli("sample", trained_run.run, *steer[2:], capsys=capsys)
    assert code == 0  # its own run


# --- the command line for people ------------------------------------------------------------

def test_the_command_printed_after_ctrl_c_continues_the_training(trained_run, tmp_path,
                                                                 capsys, monkeypatch) -> None:
    import glassgpt.cli.common as cli_common

    def interrupting(bar, metrics_line):
        return lambda step, record: os.kill(os.getpid(), signal.SIGINT) if step == 1 else None

    monkeypatch.setattr(cli_common, "dictionary_reporter", interrupting)
    out = tmp_path / "my sae"  # a space: the printed command quotes it
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):  # in-process, main raises it again once handled
        main(train_args(trained_run.run, out, "--tokens", "512", "--lr", "3e-3"))
    printed = re.search(r"continue with: (.*)", capsys.readouterr().err).group(1)
    monkeypatch.undo()
    words = shlex.split(printed)
    assert words[:3] == ["glassgpt", "sae", "train"]
    code, stdout, _ = cli(*words[1:], capsys=capsys)
    assert code == 0 and "for 4 steps" in stdout  # --tokens 512 and the rest: the saved ones
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["settings"]["lr"] == 3e-3 and state["step"] == 4


def test_a_new_training_needs_the_hook_and_the_width(trained_run, tmp_path, capsys) -> None:
    code, _, err = cli("sae", "train", trained_run.run, "--out", tmp_path / "s", capsys=capsys)
    assert code == 2 and "--hook, --d-sae" in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("extra, says", [
    (["--seed", str(2**70)], "seed must be at most 2**63 - 1, got an integer of 71 bits"),
    (["--l1", "3"], "l1_coefficient is a setting of standard, not of topk"),
    (["--l0", "3"], "l0_coefficient is a setting of jumprelu, not of topk"),
], ids=["seed-past-64-bits", "l1-with-topk", "l0-with-topk"])
def test_a_setting_out_of_reach_or_of_another_architecture_is_one_line(
        trained_run, tmp_path, capsys, extra, says) -> None:
    """A seed past 64 bits was torch's traceback; --l1 or --l0 with topk trained as if not
    given, without a word."""
    code, _, err = cli(*train_args(trained_run.run, tmp_path / "s", *extra), capsys=capsys)
    assert code == 2 and says in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_force_never_replaces_a_link_to_a_dictionary(trained_run, trained_sae, tmp_path,
                                                     capsys) -> None:
    """The link was swapped for a new directory, and left behind as .link.replaced."""
    (tmp_path / "link").symlink_to(trained_sae)
    code, _, err = cli(*train_args(trained_run.run, tmp_path / "link", "--force"),
                       capsys=capsys)
    assert code == 2 and "is a symbolic link" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]
    assert (tmp_path / "link").is_symlink()


def test_the_density_histograms_bars_scale_to_the_largest_count(trained_run, trained_sae,
                                                                capsys) -> None:
    from glassgpt.cli.sae import HISTOGRAM_WIDTH

    code, stdout, _ = cli("sae", "eval", trained_sae, "--run", trained_run.run, "--tokens",
                          "64", capsys=capsys)
    assert code == 0
    rows = [re.fullmatch(r"\s+\[.*\)\s+(\d+)\s*(#*)", line)
            for line in stdout.split("log10 feature density:\n")[1].splitlines()]
    counts, bars = [int(r.group(1)) for r in rows], [len(r.group(2)) for r in rows]
    assert sum(counts) == 16 and max(bars) == HISTOGRAM_WIDTH  # 16 latents: not 16 characters
    largest = max(counts)
    assert bars == [max(1, round(HISTOGRAM_WIDTH * c / largest)) if c else 0 for c in counts]


def test_the_scaling_and_resampling_settings_are_flags(trained_run, tmp_path, capsys) -> None:
    """--normalize-activations and --resample-every reach the training's settings; resampling
    is a setting of standard and jumprelu, refused with topk in one line."""
    out = tmp_path / "s"
    args = train_args(trained_run.run, out, "--normalize-activations", "none",
                      "--resample-every", "7")
    args[args.index("topk")] = "jumprelu"
    args[args.index("--k"):args.index("--k") + 2] = []
    code, _, err = cli(*args, capsys=capsys)
    assert code == 0, err
    settings = json.loads((out / "trainer_state.json").read_text())["settings"]
    assert (settings["normalize_activations"], settings["resample_every"]) == ("none", 7)
    code, _, err = cli(*train_args(trained_run.run, tmp_path / "t", "--resample-every", "7"),
                       capsys=capsys)
    assert code == 2 and "resample_every" in err and "topk" in err and err.count("\n") == 1
