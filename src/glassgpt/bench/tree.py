"""This checkout's speed in one line of JSON, to set two checkouts side by side:

    for tree in OLD/src NEW/src; do PYTHONPATH=$tree python -m glassgpt.bench.tree cpu-small; done

Decoding: `generate` of block_size - 1 tokens, batch 1, KV cache, greedy; training: one AdamW
step at batch 12 x block_size. One thread; each figure is the best of many repeats in CPU time
(`time.process_time`), which a shared, contended core distorts least. Alternate the trees a few
times and compare the spreads (BENCHMARKS.md, "Hook points unused cost nothing measurable").
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

from glassgpt.config import GPTConfig, load_preset
from glassgpt.decoding.generate import generate
from glassgpt.model import GPT


def best_cpu_seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best


def measure(preset: str, repeats: int = 30) -> dict[str, float]:
    torch.set_num_threads(1)
    config = GPTConfig.from_dict(load_preset(preset)["model"])
    torch.manual_seed(0)
    model = GPT(config).eval()
    new = config.block_size - 1
    prompt = torch.zeros(1, 1, dtype=torch.long)
    decode = best_cpu_seconds(
        lambda: generate(model, prompt, max_new_tokens=new, temperature=0.0), repeats)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config.vocab_size, (12, config.block_size))

    def step() -> None:
        _, loss = model(batch, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train = best_cpu_seconds(step, repeats)
    return {"decode_tok_s": round(new / decode), "train_step_ms": round(1000 * train, 2)}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else "cpu-small")))
