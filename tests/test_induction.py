"""`glassgpt demo induction` at its reduced (--quick) size: over three seeds the 2-layer
attention-only model must change phase (its repeated-part loss falls as an induction head forms,
in the same steps) while the 1-layer control cannot, and the Tiny Shakespeare model's best
induction head sits above layer 0. Plus the data, the attention-only model and the picture.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from conftest import quick_experiment
from glassgpt.cli import main
from glassgpt.experiments import EXPERIMENTS
from glassgpt.experiments.induction import (
    LAYERS,
    QUICK,
    SCORE_SEED,
    crossing_step,
    model_of,
    repeat_batch,
)
from glassgpt.interp.core.hooked import hook_points
from glassgpt.interp.methods.scores import head_scores
from glassgpt.rundir.checkpoint import load_model
from glassgpt.view.server import load_for_view

DOCS = Path(__file__).resolve().parents[1] / "docs"

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quick_size_shows_the_phase_change_for_every_seed(tmp_path: Path, seed: int) -> None:
    result = quick_experiment("induction", tmp_path, seed=seed)
    failed = [check.claim for check in result.checks if not check.holds]
    assert not failed, f"seed {seed}: expected outcomes not shown: {failed}"
    # three on the repeats, two through the snapshots, one on layer 0 of Shakespeare
    assert len(result.checks) == 6
    assert [p.name for p in result.pictures] == ["induction.png", "induction_timeline.png"]
    assert (tmp_path / "induction.png").read_bytes()[:8] == PNG_MAGIC
    two, one = result.numbers[LAYERS[2]], result.numbers[LAYERS[1]]
    assert two["steps"] == one["steps"] and two["steps"][0] == 0
    assert len(two["scores"][0]) == 2 and len(one["scores"][0]) == 1  # (L, H) per reading
    assert two["repeated_loss"][0] > two["final_loss"]
    assert [row[0] for row in result.tables[1].rows] == list(
        range(result.numbers["shakespeare"]["n_layer"]))


def test_demo_is_listed() -> None:
    assert "induction" in EXPERIMENTS


def test_repeat_batch_repeats_a_variable_stretch_at_the_end() -> None:
    tokens, predictable = repeat_batch(64, 8, 2, 50, torch.Generator().manual_seed(0))
    assert tokens.shape == predictable.shape == (64, 16)
    lengths = set()
    for row, wanted in zip(tokens, predictable, strict=True):
        n = int(wanted.sum()) + 1  # the first repeated token is not predictable
        lengths.add(n)
        assert torch.equal(row[16 - n:], row[16 - 2 * n:16 - n])
        assert wanted[16 - n + 1:].all() and not wanted[:16 - n + 1].any()
    assert lengths <= set(range(2, 9)) and len(lengths) > 3  # the offset varies


def test_attention_only_model_has_no_mlp_and_keeps_the_hook_names() -> None:
    torch.manual_seed(0)
    model = model_of(2, dataclasses.replace(QUICK, vocab_size=20, half=8, n_head=2, n_embd=16),
                     seed=0)
    names = set(hook_points(model))
    assert {"blocks.1.attn.hook_pattern", "blocks.0.hook_attn_out",
            "blocks.1.hook_resid_post"} <= names
    assert not any("mlp" in name or "ln2" in name or "resid_mid" in name for name in names)
    assert not any(".ffn." in name or ".ln2." in name for name, _ in model.named_parameters())
    ids = torch.randint(20, (3, 16))
    block = model.blocks[0]
    x = model.embed(ids, model.positions[:16])
    assert torch.allclose(block(x), x + block.attn(block.ln1(x)))
    scores = head_scores(model, half=8, batch=2)
    assert scores.induction.shape == (2, 2)


def test_crossing_step_is_where_a_curve_went_half_way() -> None:
    assert crossing_step([0, 10, 20, 30], [4.0, 3.9, 1.0, 0.8]) == 20
    assert crossing_step([0, 10, 20, 30], [0.0, 0.1, 0.7, 0.8]) == 20
    assert crossing_step([0, 10, 20], [0.02, 0.03, 0.05]) is None  # nothing happened


def test_the_2_layer_model_is_saved_as_a_run_that_sample_and_view_open(tmp_path: Path,
                                                                       capsys) -> None:
    """`demo induction` saved no run to open (issue 38); the quick run of seed 0 now has one."""
    result = quick_experiment("induction", tmp_path, seed=0)
    run = Path(result.numbers["run"])
    model, tokenizer = load_model(run)
    scores = head_scores(model, half=QUICK.half, batch=QUICK.score_batch, seed=SCORE_SEED)
    trained = torch.tensor(result.numbers[LAYERS[2]]["scores"][-1])  # (L, H), while training
    assert torch.allclose(scores.induction, trained, atol=1e-6)  # the very model, saved
    view = load_for_view(run, threads=1)
    assert view.head_scores() is not None and view.predictions("abcdefgh abcdefgh")
    code = main(["sample", str(run), "--prompt", "xyz xyz", "--max-new-tokens", "4",
                 "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("xyz xyz") and len(out.rstrip("\n")) == 11


def test_the_docs_walk_prints_its_numbers_rounded_on_the_demos_run(tmp_path: Path,
                                                                    capsys) -> None:
    """docs/interpretability.md's walk printed float32 noise (0.05999999865889549) where it
    meant 0.06. Run as pasted on the demo's saved run (its characters include the walk's)."""
    run = Path(quick_experiment("induction", tmp_path, seed=0).numbers["run"])
    walk = (DOCS / "interpretability.md").read_text().split("<!-- section: walk -->")[1]
    code = re.search(r"```python\n(.*?)```", walk, re.DOTALL).group(1)
    exec(compile(code.replace('"runs/repeats"', repr(str(run))), "docs/interpretability.md",
                 "exec"), {})
    printed = capsys.readouterr().out
    assert "induction (layer x head): [[" in printed and "of the clean answer" in printed
    assert not re.findall(r"\d\.\d{4,}", printed), printed


def test_the_docs_graph_walk_finds_the_induction_head_on_the_demos_run(tmp_path: Path,
                                                                      capsys) -> None:
    """docs/interpretability.md's graph walk, run as pasted on the demo's attention-only run
    (no MLP, so no transcoders): the strongest push on the answer is B where it first appeared,
    and the head that carries most of it is the run's induction head by its scores."""
    run = Path(quick_experiment("induction", tmp_path, seed=0).numbers["run"])
    walk = (DOCS / "interpretability.md").read_text().split("<!-- section: graph walk -->")[1]
    code = re.search(r"```python\n(.*?)```", walk, re.DOTALL).group(1)
    assert 'load_transcoders(["runs/repeats-transcoders"])' in code
    code = code.replace('"runs/repeats"', repr(str(run)))
    code = code.replace('load_transcoders(["runs/repeats-transcoders"])', "[]")
    scope: dict = {}
    exec(compile(code, "docs/interpretability.md", "exec"), scope)
    printed = capsys.readouterr().out
    assert "0 active features; replacement score 1.00, completeness score 1.00" in printed
    graph, split, row = scope["graph"], scope["split"], scope["row"]
    assert int(row.abs().argmax()) == graph.token_index(10)  # B, the first time
    assert f"B at 10 -> answer {split.weight:+.2f}" in printed
    assert split.weight == pytest.approx(float(row[graph.token_index(10)]))
    layer, head, share = split.top(1)[0]
    model, _ = load_model(run)
    scores = head_scores(model, half=QUICK.half, batch=QUICK.score_batch, seed=SCORE_SEED)
    assert (layer, head) == divmod(int(scores.induction.argmax()), model.config.n_head)
    assert share > split.weight / 2


def test_the_demos_run_exports_to_transformers_with_the_same_logits(tmp_path: Path,
                                                                     capsys) -> None:
    """`convert --to-hf` refused the demo's run (rotary positions with LayerNorm were neither
    GPT-2 nor Llama, issue 38); it is GPT-NeoX's sequential block, and transformers computes
    what glassgpt does."""
    transformers = pytest.importorskip("transformers")
    run = Path(quick_experiment("induction", tmp_path, seed=0).numbers["run"])
    out = tmp_path / "hf"
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0
    assert "model only" in capsys.readouterr().out  # a character tokenizer has no HF twin
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "GPTNeoXForCausalLM"
    model, tokenizer = load_model(run)
    ids = torch.tensor([tokenizer.encode("abcdefgh abcdefgh")])  # (1, T)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids)[0], atol=1e-5, rtol=0)
