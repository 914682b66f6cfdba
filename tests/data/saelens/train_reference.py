"""SAELens's trainer on cached activations of a tiny glassgpt model: the numbers that
tests/test_sae_reference.py holds glassgpt's trainer to (training_reference.json).

Two steps, each in its own venv (SAELens cannot sit beside glassgpt's transformer-lens 4):

    .venv/bin/python tests/data/saelens/train_reference.py activations /tmp/acts.safetensors
    /tmp/saelens_venv/bin/python tests/data/saelens/train_reference.py train \
        /tmp/acts.safetensors tests/data/saelens/training_reference.json

`activations` runs the recipe below through glassgpt (tests/test_sae_reference.py's
`reference_activations`, the same function the test calls) and saves the train and held-out
activations. `train` feeds them, in order, one batch a step, to SAELens's `SAETrainer` (its
`data_provider` is any iterator of (batch, d_in) tensors, so no model or dataset is involved)
for each architecture and seed, then measures every trained dictionary on the held-out
activations with the formulas of `held_out_metrics` and writes the recipe, the settings, the
activations' checksums and the numbers to the json.
"""

import json
import sys
from pathlib import Path

import torch

# The one source of the comparison's numbers: the test reads them back from the json.
RECIPE = {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32,
          "model_seed": 0, "ids_seed": 1, "hook": "blocks.1.hook_resid_post",
          "train_windows": 2048, "held_out_windows": 256}
COMMON = {"d_sae": 256, "batch_tokens": 512, "lr": 1e-3, "lr_warm_up_steps": 10,
          "lr_decay_steps": 25, "decoder_init_norm": 0.1, "dead_steps": 20}
ARCHITECTURES = {"standard": {"l1_coefficient": 0.05},
                 "topk": {"k": 8, "aux_loss_coefficient": 1.0},
                 "batchtopk": {"k": 8.0, "aux_loss_coefficient": 1.0, "topk_threshold_lr": 0.05},
                 "jumprelu": {"l0_coefficient": 0.001, "jumprelu_init_threshold": 0.001,
                              "jumprelu_bandwidth": 0.001}}
SEEDS = (0, 1, 2)


def held_out_metrics(x: torch.Tensor, f: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """L0 (mean nonzero latents a token), explained variance 1 - MSE / Var(x) with MSE and
    Var summed over the width and averaged over tokens (SAELens's definitions), in float64."""
    x, x_hat = x.double(), x_hat.double()
    mse = (x_hat - x).pow(2).sum(-1).mean()
    variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    return {"l0": float((f != 0).double().sum(-1).mean()),
            "explained_variance": float(1 - mse / variance)}


def checksums(acts: torch.Tensor) -> dict:
    acts = acts.double()
    return {"shape": list(acts.shape), "sum": float(acts.sum()),
            "sum_of_squares": float(acts.pow(2).sum())}


def write_activations(path: str) -> None:
    from safetensors.torch import save_file
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from test_sae_reference import reference_activations
    train, held_out = reference_activations(RECIPE)
    save_file({"train": train.contiguous(), "held_out": held_out.contiguous()}, path)


def saelens_dictionary(architecture: str, d_in: int, seed: int):
    """SAELens's training dictionary of `architecture`; the fixture's settings use SAELens's
    field names, which are glassgpt's too."""
    import sae_lens
    classes = {"standard": "StandardTrainingSAE", "topk": "TopKTrainingSAE",
               "batchtopk": "BatchTopKTrainingSAE", "jumprelu": "JumpReLUTrainingSAE"}
    sae_class = getattr(sae_lens, classes[architecture])
    cfg_class = getattr(sae_lens, classes[architecture] + "Config")
    torch.manual_seed(seed)
    return sae_class(cfg_class(d_in=d_in, d_sae=COMMON["d_sae"],
                               decoder_init_norm=COMMON["decoder_init_norm"],
                               **ARCHITECTURES[architecture]))


def train_in_saelens(architecture: str, train: torch.Tensor, seed: int):
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer
    batch = COMMON["batch_tokens"]
    cfg = SAETrainerConfig(
        total_training_samples=train.shape[0], train_batch_size_samples=batch,
        lr=COMMON["lr"], lr_end=COMMON["lr"] / 10,  # the runner's default; "constant" ignores it
        lr_warm_up_steps=COMMON["lr_warm_up_steps"],
        lr_decay_steps=COMMON["lr_decay_steps"], dead_feature_window=COMMON["dead_steps"],
        device="cpu")
    sae = saelens_dictionary(architecture, train.shape[1], seed)
    batches = iter(train.split(batch))  # in order, as glassgpt's trainer reads them
    return SAETrainer(cfg, sae, data_provider=batches).fit()


def inference_dictionary(trained):
    """The dictionary as SAELens's trainer saves it (a BatchTopK one becomes a JumpReLU of
    the batch threshold), loaded back."""
    import tempfile

    from sae_lens import SAE
    with tempfile.TemporaryDirectory() as folder:
        trained.save_inference_model(folder)
        return SAE.load_from_disk(folder).eval()


def write_reference(acts_path: str, out: str) -> None:
    import sae_lens
    from safetensors.torch import load_file
    acts = load_file(acts_path)
    train, held_out = acts["train"], acts["held_out"]
    results = {}
    for architecture in ARCHITECTURES:
        per_seed = []
        for seed in SEEDS:
            sae = inference_dictionary(train_in_saelens(architecture, train, seed))
            with torch.no_grad():
                f = sae.encode(held_out)
                per_seed.append(held_out_metrics(held_out, f, sae.decode(f)))
        results[architecture] = {
            "per_seed": per_seed,
            "mean": {key: sum(m[key] for m in per_seed) / len(per_seed)
                     for key in per_seed[0]}}
    reference = {"saelens": sae_lens.__version__, "torch": torch.__version__,
                 "recipe": RECIPE, "common": COMMON, "architectures": ARCHITECTURES,
                 "seeds": list(SEEDS), "train": checksums(train),
                 "held_out": checksums(held_out), "results": results}
    Path(out).write_text(json.dumps(reference, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["activations"]:
        write_activations(sys.argv[2])
    else:
        write_reference(sys.argv[2], sys.argv[3])
