"""Progress where a command works for long (issue 53, goal 1): `sae train`, `sae eval` and
`graph` say what they are about to do in one line, the library reports its steps through
callbacks (it prints nothing), and the command line draws them: a bar on a terminal only, and
an estimate from the measured rate once a few steps ran (cli.common.Estimate). No test here
depends on how fast anything runs: the clocks are fake where time matters."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from glassgpt.cli import graph as graph_cli
from glassgpt.cli import main
from glassgpt.cli.common import Estimate, EstimatingReporter, duration_text, reports_left
from glassgpt.interp.graph import attribution_graph
from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.interp.sae.evaluate import evaluate_on_run
from glassgpt.interp.sae.training import DictionarySettings, train_dictionary
from glassgpt.rundir.checkpoint import load_model

HOOK = "blocks.0.hook_resid_post"
BAR = "━"  # what rich draws a bar with: never in a log or a pipe


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_estimate_waits_for_a_few_measured_steps_past_the_first_and_speaks_once() -> None:
    clock = FakeClock()
    estimate = Estimate(100, "steps", ", plus 2 metric reports", clock=clock)
    clock.now = 10.0  # step 1 ends the warm-up, however long it took
    assert estimate.line(1) is None
    clock.now = 12.0
    assert estimate.line(3) is None  # 2 steps: too few to say
    clock.now = 13.0
    assert estimate.line(4) == ("estimated 1 min 36 s for the 96 steps left, at 1.0 steps/s "
                                "(measured over 3 steps), plus 2 metric reports")
    clock.now = 20.0
    assert estimate.line(10) is None  # said once
    fast = Estimate(1000, "tokens", clock=clock)
    for done in (0, 100, 200, 300, 400):  # many tokens at once, but less than 3 s measured
        clock.now += 0.5
        assert fast.line(done) is None
    assert duration_text(45.4) == "45 s" and duration_text(3725) == "1 h 02 min"


def test_the_fine_tune_estimate_adds_the_evaluations_the_first_one_measured(capsys) -> None:
    class Inner:
        output_closed = False

        def __init__(self) -> None:
            self.calls: list[str] = []

        def start(self, total: int, done: int) -> None:
            self.calls.append(f"start {total} {done}")

        def log(self, record: dict) -> None:
            self.calls.append(f"log {record['iter']}")

        def eval(self, record: dict) -> None:
            self.calls.append(f"eval {record['iter']}")

        def stop(self) -> None:
            self.calls.append("stop")

    clock, inner = FakeClock(), Inner()
    reporter = EstimatingReporter(inner, clock=clock)
    reporter.eval_every = 250
    reporter.start(1000, 0)
    clock.now = 5.0  # the evaluation at step 0 (and the first checkpoint): 5 s
    reporter.eval({"iter": 0})
    for it, now in ((10, 6.0), (20, 8.0), (30, 10.0)):
        clock.now = now
        reporter.log({"iter": it})
    reporter.stop()
    assert inner.calls == ["start 1000 0", "eval 0", "log 10", "log 20", "log 30", "stop"]
    # 970 steps at 0.2 s, and 4 evaluations (250, 500, 750, 1000) of 5 s each
    assert capsys.readouterr().err == ("estimated 3 min 34 s for the 970 steps left, at 5.0 "
                                       "steps/s (measured over 20 steps), and 4 evaluations of "
                                       "5 s\n")
    assert reports_left(30, 1000, 250) == 4 and reports_left(0, 10, 0) == 1
    assert reports_left(0, 1001, 250) == 5 and reports_left(10, 10, 4) == 0


def test_sae_train_starts_with_a_line_and_reports_every_step(trained_run, tmp_path: Path,
                                                             capsys) -> None:
    out = tmp_path / "sae"
    capsys.readouterr()
    assert main(["sae", "train", str(trained_run.run), "--hook", HOOK, "--out", str(out),
                 "--d-sae", "16", "--architecture", "topk", "--k", "2", "--tokens", "384",
                 "--batch-tokens", "128", "--eval-every", "2"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == (f"training a topk SAE of 16 latents, k 2, on {HOOK} (width 16) of "
                        f"{trained_run.run}: 3 steps of 128 activations (384 in all, windows "
                        f"of 16 tokens), metrics every 2 steps")
    assert [line.split(":")[0] for line in lines[1:]] == ["step 2", "step 3"]
    # dead and dense counted on a few held-out tokens: the line says how many
    assert all(re.search(r" dense \(\d[\d,]* tokens\)$", line) for line in lines[1:]), lines
    assert BAR not in err  # stderr is no terminal here: no bar
    settings = DictionarySettings(hook=HOOK, d_sae=16, architecture="topk", k=2, tokens=640,
                                  batch_tokens=128, eval_every=2)
    starts, steps = [], []
    train_dictionary(trained_run.run, settings, out, resume=True, on_start=starts.append,
                     report=lambda step, record: steps.append(step))
    assert [start.step for start in starts] == [3] and steps == [4, 5]
    assert (starts[0].d_in, starts[0].d_out, starts[0].context) == (16, 16, 16)


def test_sae_eval_starts_with_a_line_and_reports_its_tokens(trained_run, tmp_path: Path,
                                                            capsys) -> None:
    sae = SAE(SAEConfig(d_in=16, d_sae=8))
    sae.cfg.metadata.hook_name = HOOK
    sae.cfg.metadata.context_size = 8
    sae.save(tmp_path / "sae")
    reports = []
    evaluate_on_run(tmp_path / "sae", trained_run.run, tokens=100, any_run=True,
                    progress=lambda done, total: reports.append((done, total)))
    # 100 tokens: 12 windows of 8, drawn in whole batches of 8 windows (64 tokens): 2 batches
    assert reports == [(0, 128), (64, 128), (128, 128)]
    capsys.readouterr()
    assert main(["sae", "eval", str(tmp_path / "sae"), "--run", str(trained_run.run),
                 "--tokens", "100", "--any-run"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (f"evaluating {tmp_path / 'sae'} on 128 tokens of the val "
                                   f"split of {trained_run.run}'s data (fewer with --tokens N)")
    assert BAR not in err


def transcoders_for(model: torch.nn.Module) -> list[SAE]:
    """A ReLU transcoder a layer whose features fire on most tokens: a graph of many rows."""
    c = model.config
    saes = []
    for layer in range(c.n_layer):
        config = SAEConfig(d_in=c.n_embd, d_sae=48, architecture="transcoder", d_out=c.n_embd,
                           apply_b_dec_to_input=False)
        config.metadata.hook_name = f"blocks.{layer}.ln2.hook_normalized"
        config.metadata.hook_name_out = f"blocks.{layer}.hook_mlp_out"
        torch.manual_seed(layer)
        sae = SAE(config)
        with torch.no_grad():
            sae.b_enc.fill_(0.1)
        saes.append(sae)
    return saes


def test_the_graph_reports_each_backward_pass_and_says_what_it_attributes(
        trained_run, tmp_path: Path, capsys, monkeypatch) -> None:
    model, tokenizer = load_model(trained_run.run)
    transcoders = transcoders_for(model)
    ids = torch.tensor([tokenizer.encode("to be or not")])
    reports = []
    graph = attribution_graph(model, transcoders, ids, batch_size=8,
                              progress=lambda g, done, total: reports.append((done, total)))
    rows = graph.n_features + graph.n_logits
    assert rows > 8 and reports[0] == (0, rows) and reports[-1] == (rows, rows)
    assert [done for done, _ in reports[1:]] == [min(rows, d) for d in range(8, rows + 8, 8)]
    for layer, sae in enumerate(transcoders):
        sae.save(tmp_path / "transcoders" / f"layer{layer}")
    command = ["graph", str(trained_run.run), "--transcoders", str(tmp_path / "transcoders"),
               "--prompt", "to be or not", "--any-run"]
    capsys.readouterr()
    monkeypatch.setattr(graph_cli, "SAY_ROWS_ABOVE", rows)  # one row short of a line
    assert main(command) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(graph_cli, "SAY_ROWS_ABOVE", rows - 1)
    assert main(command) == 0
    logits = f"{graph.n_logits} logit{'s' if graph.n_logits != 1 else ''}"
    assert capsys.readouterr().err == (f"attributing {rows:,} rows of the adjacency "
                                       f"({graph.n_features} active features at "
                                       f"{graph.n_pos} tokens and {logits})\n")
