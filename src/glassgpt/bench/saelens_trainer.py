"""SAELens's side of `glassgpt bench sae`, run by the python of a venv that has sae_lens (it
cannot be installed beside glassgpt): this file imports nothing of glassgpt.

    SAELENS_PYTHON saelens_trainer.py ACTIVATIONS.safetensors SIZE_JSON

trains SAELens's TopKTrainingSAE with its SAETrainer on the file's "train" activations, fed in
order one batch a step and round again (as glassgpt's TensorActivations reads them), with the
settings of SIZE_JSON (glassgpt.bench.sae.SAEBenchSize) and glassgpt's defaults for the rest
(no warm-up, the lr decayed over the last fifth of the steps); prints one JSON line: the
seconds after the warm-up steps, the activations they trained on, the peak resident memory and
the explained variance on the file's "held_out" activations.
"""

import json
import resource
import sys
import time

import torch
from safetensors.torch import load_file

WARMUP_STEPS = 3  # glassgpt.bench.sae.WARMUP_STEPS


def batches(train: torch.Tensor, batch: int, clock: dict):
    """The rows in order, round and round; the clock starts when step WARMUP_STEPS + 1 asks."""
    step = 0
    while True:
        for start in range(0, train.shape[0] - batch + 1, batch):
            if step == WARMUP_STEPS:
                clock["start"] = time.perf_counter()
            step += 1
            yield train[start:start + batch]


def main(path: str, size: dict) -> dict:
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer
    acts = load_file(path)
    steps = size["tokens"] // size["batch_tokens"]
    cfg = SAETrainerConfig(total_training_samples=steps * size["batch_tokens"],
                           train_batch_size_samples=size["batch_tokens"], lr=size["lr"],
                           lr_end=size["lr"] / 10, lr_decay_steps=steps // 5,
                           dead_feature_window=size["dead_feature_window"], device="cpu")
    torch.manual_seed(0)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(
        d_in=size["d_model"], d_sae=size["d_model"] * size["expansion"], k=size["k"]))
    clock: dict = {}
    SAETrainer(cfg, sae, data_provider=batches(acts["train"], size["batch_tokens"],
                                               clock)).fit()
    seconds = time.perf_counter() - clock["start"]
    with torch.no_grad():
        x = acts["held_out"].double()
        x_hat = sae.decode(sae.encode(acts["held_out"])).double()
    variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    return {"seconds": seconds, "timed_tokens": (steps - WARMUP_STEPS) * size["batch_tokens"],
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "explained_variance": float(1 - (x_hat - x).pow(2).sum(-1).mean() / variance)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))))
