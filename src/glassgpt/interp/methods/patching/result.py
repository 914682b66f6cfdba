"""What a patching sweep measures with each patched run, and how it is handed back.

The default sweep keeps one number per patch (the metric of the batch) and returns a tensor,
as TransformerLens always has. TransformerLens 4.x's keyword-only `reduce=` and `baseline=`
(and a mapping of several named metrics) keep more, and then a `PatchingResult` comes back:

    reduce="scalar"  the metric returns one number; a tensor of the swept axes
    reduce="mean"    the metric returns one number per prompt (batch,); their mean, a tensor
    reduce="none"    the metric returns (batch,); all kept: a PatchingResult
    baseline=True    one more run, unpatched: the corrupted run's own metric, in the result

`PatchingResult.values` is laid out [metric?, *swept axes, batch?]: a metric axis only for a
mapping of metrics, a batch axis only with reduce="none". TransformerLens's pandas parts
(index_df, to_dataframe) are not offered: glassgpt does not depend on pandas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from glassgpt.errors import InputError

Metric = Callable[[Tensor], Tensor | float]
REDUCE_MODES = ("scalar", "mean", "none")
# The sweeps' names for one axis, as the stacked (*_every) results name it.
AXIS_RENAMES = {"head_index": "head", "dest_pos": "pos"}


@dataclass
class PatchingResult:
    """Per-prompt (or per-metric) patching values, with the statistics read off them.

    values: [metric?, *axis_names, batch?]; axis_names: the swept axes (with "patch_type"
    first from a *_every function, whose entries patch_type_names names); metric_names:
    ["metric"] for one function; reduced: the batch axis was averaged away; baseline: the
    unpatched corrupted run's metric, [metric?, batch?], when the sweep ran with baseline=True.
    """

    values: Tensor
    axis_names: list[str]
    metric_names: list[str]
    reduced: bool
    baseline: Tensor | None = None
    has_metric_axis: bool = False
    patch_type_names: list[str] | None = None

    def __getitem__(self, metric_name: str) -> PatchingResult:
        """The result of one metric of a mapping, its metric axis dropped."""
        if metric_name not in self.metric_names:
            raise InputError(f"no metric {metric_name!r} in this result; it has "
                             f"{', '.join(map(repr, self.metric_names))}")
        if not self.has_metric_axis:
            return self
        i = self.metric_names.index(metric_name)
        return PatchingResult(self.values[i], list(self.axis_names), [metric_name], self.reduced,
                              None if self.baseline is None else self.baseline[i], False,
                              self.patch_type_names)

    def mean(self) -> Tensor:
        """The batch mean of each cell (the values themselves once reduced)."""
        return self.values if self.reduced else self.values.mean(dim=-1)

    def stderr(self) -> Tensor:
        """The standard error of each cell's batch mean (unbiased std / sqrt(batch))."""
        self._need_per_prompt("stderr")
        n = self.values.shape[-1]
        if n < 2:
            raise InputError(f"stderr needs a batch of at least 2 prompts, got {n}")
        return self.values.std(dim=-1, unbiased=True) / n ** 0.5

    def effect(self) -> Tensor:
        """values - baseline: how far each patch moves the corrupted run, per prompt."""
        return self.values - self._baseline_like_values()

    def normalized(self, clean_baseline: Tensor) -> Tensor:
        """(values - corrupted) / (clean - corrupted): 0 where a patch changed nothing, 1 where
        it restored the clean run. `clean_baseline` is the metric of the unpatched clean run,
        shaped like `baseline`; a prompt whose two runs agree divides by 0 (inf or nan)."""
        corrupted = self._baseline_like_values()
        clean = torch.as_tensor(clean_baseline, dtype=self.values.dtype,
                                device=self.values.device)
        if clean.shape != self.baseline.shape:
            raise InputError(f"clean_baseline must have the baseline's shape "
                             f"{tuple(self.baseline.shape)}, got {tuple(clean.shape)}")
        return (self.values - corrupted) / (clean.reshape(corrupted.shape) - corrupted)

    def _need_per_prompt(self, what: str) -> None:
        if self.reduced:
            raise InputError(f"{what} needs each prompt's value: run the sweep with "
                             "reduce='none'")

    def _baseline_like_values(self) -> Tensor:
        """The baseline [metric?, batch?] with a 1 for each swept axis, to broadcast."""
        if self.baseline is None:
            raise InputError("this result has no baseline: run the sweep with baseline=True")
        lead = 1 if self.has_metric_axis else 0
        swept = self.values.dim() - lead - (0 if self.reduced else 1)
        shape = (*self.baseline.shape[:lead], *(1,) * swept, *self.baseline.shape[lead:])
        return self.baseline.reshape(shape)


# --- the metric, run on each patched run's logits -----------------------------------------------

class Metrics:
    """The patching metric (one function, or a mapping name -> function) under a reduce mode:
    `measure(logits, where)` gives [metric] numbers, or [metric, batch] per prompt."""

    def __init__(self, patching_metric: object, reduce: object, baseline: object, batch: int):
        if not isinstance(reduce, str) or reduce not in REDUCE_MODES:
            raise InputError(f"reduce must be one of {', '.join(map(repr, REDUCE_MODES))}, got "
                             f"{reduce!r:.40}")
        if not isinstance(baseline, bool):
            raise InputError(f"baseline must be True or False, got {baseline!r:.40}")
        self.named = isinstance(patching_metric, Mapping)
        self.functions = dict(patching_metric) if self.named else {"metric": patching_metric}
        if not self.functions:
            raise InputError("patching_metric is an empty mapping: give at least one metric")
        for name, fn in self.functions.items():
            if not isinstance(name, str) or not callable(fn):
                got = f"{name!r:.40}: " if self.named else ""
                raise InputError(f"patching_metric must be a function logits -> number, or a "
                                 f"mapping name -> such a function; got {got}"
                                 f"{type(fn).__name__}")
        self.reduce, self.baseline, self.batch = reduce, baseline, batch

    @property
    def per_prompt(self) -> bool:
        return self.reduce != "scalar"

    @property
    def wants_result(self) -> bool:
        """TransformerLens returns its PatchingResult for these; a tensor otherwise."""
        return self.named or self.reduce == "none" or self.baseline

    def store_shape(self, swept: Sequence[int]) -> tuple[int, ...]:
        return (len(self.functions), *swept, *((self.batch,) if self.per_prompt else ()))

    def measure(self, logits: Tensor, where: object) -> Tensor:
        """Every metric of one run's logits: (metric,) or (metric, batch), float32."""
        rows = []
        for name, fn in self.functions.items():
            label = f"the patching metric {name!r}" if self.named else "the patching metric"
            value = fn(logits)
            rows.append(self._per_prompt(value, label, where) if self.per_prompt
                        else torch.tensor(metric_value(value, where, label)))
        return torch.stack(rows)

    def _per_prompt(self, value: object, label: str, where: object) -> Tensor:
        """A (batch,) tensor of finite real numbers, as float32 on the CPU."""
        want = f"a (batch,) tensor of {self.batch} numbers under reduce={self.reduce!r}"
        if not isinstance(value, Tensor) or value.shape != (self.batch,) \
                or value.is_complex() or value.dtype == torch.bool:
            got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                   if isinstance(value, Tensor) else type(value).__name__)
            raise InputError(f"{label} must return {want}, got {got} at {where}")
        value = value.detach().float().cpu()
        if not torch.isfinite(value).all():
            raise InputError(f"{label} returned {value.tolist()!r:.60} at {where}: not finite "
                             "numbers (the map is float32)")
        return value

    def result(self, store: Tensor, axis_names: Sequence[str],
               baseline: Tensor | None) -> Tensor | PatchingResult:
        """The sweep's answer: the tensor of the swept axes, or a PatchingResult."""
        if self.reduce == "mean":  # the prompts' values were kept to be averaged here
            store = store.mean(dim=-1)
            baseline = None if baseline is None else baseline.mean(dim=-1)
        if not self.wants_result:
            return store[0]
        if not self.named:  # one function: no metric axis
            store, baseline = store[0], None if baseline is None else baseline[0]
        return PatchingResult(store, list(axis_names), list(self.functions),
                              self.reduce != "none", baseline, self.named)


def metric_value(value: object, where: object, label: str = "the patching metric") -> float:
    """A metric's result as one finite float32 number, or InputError naming what came back."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise InputError(f"{label} must return one real number, got a {value.dtype} tensor "
                             f"of shape {tuple(value.shape)} at {where} (for one number per "
                             "prompt, pass reduce='mean' or reduce='none')")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{label} must return one real number, got {type(value).__name__} "
                         f"at {where}")
    if not abs(value) <= torch.finfo(torch.float32).max:  # NaN fails this too
        raise InputError(f"{label} returned {value!r:.20} at {where}: not a finite number "
                         "(the map is float32)")
    return float(value)


# --- several sweeps stacked on a patch_type axis (the *_every functions) -----------------------

def as_result(out: Tensor | PatchingResult, axis_names: Sequence[str]) -> PatchingResult:
    """A sweep's tensor answer dressed as a reduced result, to be stacked with others."""
    if isinstance(out, PatchingResult):
        return out
    return PatchingResult(out, list(axis_names), ["metric"], reduced=True)


def stack_patch_types(results: Sequence[PatchingResult], axis_order: Sequence[str],
                      n_heads: int, type_names: Sequence[str]) -> PatchingResult:
    """Sweeps of one metric set and reduce mode -> one result with a leading patch_type axis:
    each sweep's axes put in `axis_order` (a pattern's (layer, head_index, dest_pos) becomes
    (layer, pos, head)), and a sweep over fewer K/V heads padded with zeros to `n_heads`."""
    first = results[0]
    lead = 1 if first.has_metric_axis else 0
    stacked = []
    for result in results:
        names = [AXIS_RENAMES.get(name, name) for name in result.axis_names]
        order = [lead + names.index(name) for name in axis_order]
        tail = range(lead + len(names), result.values.dim())  # the batch axis, if kept
        values = result.values.permute(*range(lead), *order, *tail)
        if "head" in axis_order:
            values = pad_heads(values, lead + list(axis_order).index("head"), n_heads)
        stacked.append(values)
    return PatchingResult(torch.stack(stacked, dim=lead), ["patch_type", *axis_order],
                          list(first.metric_names), first.reduced, first.baseline,
                          first.has_metric_axis, list(type_names))


def pad_heads(values: Tensor, axis: int, n_heads: int) -> Tensor:
    """Zeros appended along `axis` up to n_heads: grouped K/V sweeps cover n_kv_head heads only,
    so those cells of the stacked map are placeholders, not measurements."""
    missing = n_heads - values.shape[axis]
    if missing <= 0:
        return values
    shape = list(values.shape)
    shape[axis] = missing
    return torch.cat([values, values.new_zeros(shape)], dim=axis)
