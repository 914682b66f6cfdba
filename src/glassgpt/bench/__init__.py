"""Speed, measured: the machine's limits, glassgpt against them, and Hugging Face GPT-2 beside it.

Library only: every function returns numbers (dataclasses); `glassgpt.cli.benchmark` prints them.

Method. Contenders of one comparison run in interleaved rounds (A B C, B C A, C A B, ...) so that
noise from other processes hits each of them alike; warm-up calls come first and are not timed;
every figure is the median of its rounds. Nothing here is a constant figure: the limits that
utilisation is measured against are probed in the same rounds as the contenders.

  * Training is compute-bound: its limit is the fp32 matmul peak. MFU = achieved model FLOP/s /
    measured peak, with 6N + 12*L*H*Q*T FLOPs per token (N = parameters that take part in matmuls,
    L layers, H heads of width Q, context T): forward + backward of every weight (2N + 4N) plus
    the attention scores and their weighted sum.
  * Decoding one token at batch 1 is memory-bound: every weight is read once per token. Its limit
    is read bandwidth / weight bytes per token.

Time to loss (`glassgpt bench ladder`: wall seconds to a target val loss, one speedrun change at
a time) is `glassgpt.bench.ladder`, imported on its own: it trains models, so it needs the
trainer, which the speed measurements here do not.

How fast `glassgpt view` answers (`python -m glassgpt.bench.view [RUN_DIR]`) is
`glassgpt.bench.view`, also imported on its own: it starts the view's server.
"""

from glassgpt.bench.decoding import (
    DecodeSpeed,
    PrecisionCost,
    bench_decoding,
    bf16_cost,
    check_decode_length,
    precision_cost,
)
from glassgpt.bench.measure import (
    GLASSGPT,
    GLASSGPT_COMPILED,
    GLASSGPT_EAGER,
    HF,
    MAX_TRAIN_BATCH,
    HFLanguageModel,
    LimitProbes,
    MachineLimits,
    bench_model,
    decode_bytes_per_token,
    hf_twin,
    interleaved_medians,
    interleaved_times,
    matmul_parameters,
    measure_limits,
    train_flops_per_token,
)
from glassgpt.bench.profiles import OpShare, profile_decode_step, profile_train_step, top_ops
from glassgpt.bench.report import BenchReport, Speedup, machine_info, run_benchmarks, speedups
from glassgpt.bench.threads import ThreadSpeed, bench_threads, competing_load
from glassgpt.bench.training import (
    TrainSpeed,
    bench_train_config,
    bench_training,
    eager_and_compiled_losses,
)
from glassgpt.config import DECODE_PRESETS, NEW_TOKENS, PROMPT_LEN, TRAIN_PRESETS

__all__ = [
    "DECODE_PRESETS", "GLASSGPT", "GLASSGPT_COMPILED", "GLASSGPT_EAGER", "HF", "MAX_TRAIN_BATCH",
    "NEW_TOKENS",
    "PROMPT_LEN", "TRAIN_PRESETS", "BenchReport", "DecodeSpeed", "HFLanguageModel",
    "LimitProbes", "MachineLimits", "OpShare", "PrecisionCost", "Speedup", "TrainSpeed",
    "bench_decoding", "bench_model", "bench_train_config", "bench_training", "bf16_cost",
    "check_decode_length", "decode_bytes_per_token", "eager_and_compiled_losses", "hf_twin",
    "interleaved_medians", "interleaved_times", "machine_info", "matmul_parameters",
    "measure_limits", "precision_cost", "profile_decode_step", "profile_train_step",
    "run_benchmarks", "speedups",
    "top_ops", "train_flops_per_token", "ThreadSpeed", "bench_threads", "competing_load",
]
