"""Remake tests/data/devinterp/: devinterp 2.0.1's LLC estimate of a small glassgpt GPT.

Run in a venv of its own (devinterp pulls datasets, zarr, xarray and pandas, none of which
glassgpt needs), with glassgpt on the path:

    python3 -m venv /tmp/dvenv
    /tmp/dvenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/dvenv/bin/pip install devinterp==2.0.1
    PYTHONPATH=src /tmp/dvenv/bin/python tests/data/devinterp/make_fixture.py tests/data/devinterp

It writes model.safetensors (a seeded random GPT: 2 layers, width 32, 2 heads, 16 tokens),
sequences.safetensors (the token sequences, int64 (N, T + 1)) and reference.json: for each
case, the settings and what devinterp's `llc()` returned (init loss, the loss of every SGLD step
per chain, burn-in included, the loss at each draw, llc per chain, mean and std) and the batches
devinterp fed each chain, as indices into the sequences.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from devinterp.slt.llc import llc
from safetensors.torch import load_file, save_file

from glassgpt.config import GPTConfig
from glassgpt.model import GPT
from glassgpt.rundir.weights import model_tensors

CONFIG = dict(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=32)
CASES = {
    # localization, burn-in and steps between draws
    "localized": dict(lr=3e-4, n_beta=20.0, localization=100.0, llc_weight_decay=0.0,
                      num_chains=2, num_draws=6, num_burnin_steps=3, num_steps_bw_draws=2,
                      batch_size=8, num_init_loss_batches=4, init_seed=100),
    # weight decay beside localization, a batch size that leaves sequences over (drop_last)
    "decayed": dict(lr=1e-4, n_beta=8.0, localization=30.0, llc_weight_decay=0.5,
                    num_chains=3, num_draws=8, num_burnin_steps=0, num_steps_bw_draws=1,
                    batch_size=7, num_init_loss_batches=7, init_seed=7),
}


class LogitsOnly(torch.nn.Module):
    """glassgpt's GPT returns (logits, loss); devinterp's default loss reads a bare tensor."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids)[0]


def make_sequences(n: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences with structure to learn: a random start, then +1 modulo vocab 60% of the
    time, else a random token (48 of them come out distinct)."""
    g = torch.Generator().manual_seed(5)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    steps = torch.where(torch.rand(n, length - 1, generator=g) < 0.6, 1,
                        torch.randint(0, vocab, (n, length - 1), generator=g))
    return torch.cat([start, start + steps.cumsum(1)], dim=1) % vocab  # (N, T + 1)


def index_of_rows(ids: torch.Tensor, sequences: torch.Tensor) -> list:
    """Every row of ids (..., T + 1) as its index among the (distinct) sequences."""
    flat = ids.reshape(-1, ids.shape[-1])
    matches = (flat[:, None, :] == sequences[None]).all(-1)  # (rows, N)
    assert (matches.sum(1) == 1).all(), "sequences must be distinct"
    return matches.float().argmax(1).reshape(ids.shape[:-1]).tolist()


def run_case(model: GPT, sequences: torch.Tensor, case: dict) -> dict:
    dataset = Dataset.from_dict({"input_ids": sequences.tolist()}).with_format("torch")
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = llc(LogitsOnly(model), dataset, {}, output_path=Path(scratch) / "s.zarr",
                     device="cpu", **case)
        from devinterp.slt.sampling import sample  # the same run, read for its batches
        samples = sample(LogitsOnly(model), dataset, {}, output_path=Path(scratch) / "s.zarr",
                         device="cpu", **case)
        ds = samples.dataset
        draw_losses = ds.sampling_loss.mean(dim=["batch", "token_pos"]).values
        batches = index_of_rows(torch.as_tensor(ds.sampling_input_ids_micro.values), sequences)
    return {"settings": case, "init_loss": float(result.init_loss),
            "step_losses": result.loss_trace.values.tolist(), "draw_losses": draw_losses.tolist(),
            "llc_per_chain": result.llc_per_chain.values.tolist(),
            "llc_mean": float(result.llc_mean), "llc_std": float(result.llc_std),
            "batches": batches}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    save_file(model_tensors(model), out / "model.safetensors")
    sequences = make_sequences(48, CONFIG["block_size"], CONFIG["vocab_size"])
    save_file({"sequences": sequences.contiguous()}, out / "sequences.safetensors")
    # devinterp is handed the model exactly as the test will load it
    model.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    reference = {"devinterp": "2.0.1", "torch": torch.__version__, "config": CONFIG,
                 "cases": {name: run_case(model, sequences, case) for name, case in CASES.items()}}
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
