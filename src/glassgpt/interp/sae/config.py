"""A dictionary's settings, as SAELens 6.x writes them in `cfg.json`: `SAEConfig` and
`SAEMetadata`, and `config_from_dict`, which reads a cfg.json's object and refuses, in one line,
anything SAELens would not have written.

The fields and their order are SAELens's (`sae_lens.saes.*Config.to_dict`):
    every architecture   d_in, d_sae, dtype, device, apply_b_dec_to_input,
                         normalize_activations, reshape_activations, metadata, architecture
    and, before architecture, the fields its record adds (`Architecture.cfg_fields`,
    glassgpt.interp.sae.architectures): topk's k and rescale_acts_by_decoder_norm, a
    transcoder's d_out.
The hook point lives in `metadata.hook_name` (a transcoder's output in `metadata.hook_name_out`),
as SAELens 6 keeps it. A BatchTopK dictionary is not an architecture of its own at inference:
SAELens saves it as "jumprelu" with the learned batch threshold for every latent and
`metadata.training_architecture = "batchtopk"` (`SAEConfig.batchtopk` builds one so).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from glassgpt.errors import ConfigError
from glassgpt.interp.sae.architectures import BATCHTOPK, LOADABLE, REGISTRY, Architecture, find
from glassgpt.storage.files import ErrorType

# SAELens's dtype names (sae_lens.constants.DTYPE_MAP); it writes the short ones.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
DTYPES.update({f"torch.{name}": dtype for name, dtype in list(DTYPES.items())})
# The normalisations SAELens's inference SAE applies nothing for: the scale or whitening is folded
# into the weights when training ends (sae_lens.saes.sae.SAE._setup_activation_normalization).
# "layer_norm" and "constant_norm_rescale" rescale each input at run time and are not supported.
IDENTITY_NORMALIZATIONS = ("none", "expected_average_only_in", "covariance_whitening")
RESHAPES = ("none", "hook_z")
# The format this module reads and writes: SAELens's 6.x, checked against 6.54.12. A cfg.json
# without metadata.sae_lens_version >= 6 is the older layout, which SAELens converts on load.
SAELENS_FORMAT_VERSION = "6.54.12"
# SAEConfig's fields that only some architectures have (Architecture.cfg_fields)
OPTIONAL_FIELDS = ("k", "rescale_acts_by_decoder_norm", "d_out")
# What glassgpt's trainer adds to the metadata of a dictionary it trains on a run: the run
# directory and the sha256 of the weights it read (glassgpt.interp.sae.provenance reads them).
TRAINED_ON_RUN, TRAINED_ON_WEIGHTS = "glassgpt_run", "glassgpt_weights_sha256"


class SAEMetadata(dict):
    """cfg.json's `metadata`: facts about where a dictionary came from (hook_name, model_name,
    sae_lens_version, training_architecture, ...), read as attributes as in SAELens
    (`cfg.metadata.hook_name`, None when absent) or as the dict it is."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends look for dunders: not ours
            raise AttributeError(name)
        return self.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


@dataclass
class SAEConfig:
    """What a sparse dictionary is, in SAELens's field names (see the module docstring).

    `d_in` is the width read at `metadata.hook_name`, `d_sae` the number of latents; a
    transcoder writes `d_out` values at `metadata.hook_name_out`. `k` (topk) is how many latents
    each input keeps; `rescale_acts_by_decoder_norm` (topk) ranks latents by pre-activation times
    their decoder row's norm and divides that norm out again when decoding.
    """

    d_in: int
    d_sae: int
    architecture: str = "standard"
    dtype: str = "float32"
    device: str = "cpu"
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    reshape_activations: str = "none"
    metadata: SAEMetadata = field(default_factory=SAEMetadata)
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    d_out: int | None = None

    def __post_init__(self) -> None:
        self.metadata = SAEMetadata(self.metadata)
        check_config(self, "SAEConfig", ConfigError)

    @classmethod
    def batchtopk(cls, d_in: int, d_sae: int, k: float, hook_name: str,
                  **fields: Any) -> SAEConfig:
        """A BatchTopK dictionary as SAELens runs it after training: a JumpReLU SAE whose
        threshold (one value for every latent) is the batch threshold learned in training."""
        metadata = SAEMetadata(fields.pop("metadata", {}), hook_name=hook_name,
                               **BATCHTOPK.saved_metadata(k))
        return cls(d_in, d_sae, BATCHTOPK.saved_as, metadata=metadata, **fields)

    @property
    def hook_name(self) -> str | None:
        """The hook point the dictionary reads (`metadata.hook_name`)."""
        return self.metadata.hook_name

    @property
    def hook_name_out(self) -> str | None:
        """Where its reconstruction goes: a transcoder's `metadata.hook_name_out`, else the
        point it reads."""
        return self.metadata.hook_name_out or self.metadata.hook_name

    @property
    def arch(self) -> Architecture:
        """The record of `architecture`: what it reads, saves and computes."""
        return REGISTRY[self.architecture]

    @property
    def is_transcoder(self) -> bool:
        return self.arch.transcoder

    @property
    def width_out(self) -> int:
        """The width of a reconstruction: d_out for a transcoder, else d_in."""
        return self.d_out if self.is_transcoder else self.d_in

    def to_dict(self) -> dict[str, Any]:
        """The cfg.json object SAELens writes for this architecture, key for key."""
        data = {"d_in": self.d_in, "d_sae": self.d_sae, "dtype": self.dtype,
                "device": self.device, "apply_b_dec_to_input": self.apply_b_dec_to_input,
                "normalize_activations": self.normalize_activations,
                "reshape_activations": self.reshape_activations,
                "metadata": {"sae_lens_version": SAELENS_FORMAT_VERSION, **self.metadata}}
        for name in self.arch.cfg_fields:
            data[name] = getattr(self, name)
        data["architecture"] = self.architecture
        return data


# --- the checks, shared by the constructor (ConfigError) and cfg.json (CheckpointError) -------

def config_from_dict(data: dict[str, Any], source: str, error: ErrorType) -> SAEConfig:
    """A cfg.json object -> SAEConfig, or `error` naming the first field SAELens would not
    have written so. Fields of SAELens's training configs (l1_coefficient, ...) are ignored,
    as SAELens ignores them when it loads."""
    check_format_version(data, source, error)
    required = ["d_in", "d_sae", "architecture", "dtype", "apply_b_dec_to_input",
                "normalize_activations"]
    arch = find(data.get("architecture"))  # None: refused by check_config below
    own_fields = [] if arch is None else list(arch.cfg_fields)
    required += own_fields
    missing = [name for name in required if name not in data]
    if missing:
        raise error(f"{source} lacks {', '.join(missing)}: not a complete SAELens cfg.json")
    given = {f.name: data[f.name] for f in dataclasses.fields(SAEConfig) if f.name in data}
    if not own_fields:  # SAELens drops another architecture's
        for name in OPTIONAL_FIELDS:
            given.pop(name, None)
    given["device"] = "cpu"  # where it is loaded, not where it was saved (as in SAELens)
    check_config(SimpleNamespace(**{**_defaults(), **given}), source, error)
    return SAEConfig(**given)


def _defaults() -> dict[str, Any]:
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(SAEConfig)
            if (f.default, f.default_factory) != (dataclasses.MISSING,) * 2}


def check_format_version(data: dict[str, Any], source: str, error: ErrorType) -> None:
    metadata = data.get("metadata")
    if not isinstance(metadata, dict):
        raise error(f"{source} has no metadata object: it is not SAELens 6's cfg.json (load "
                    f"and save it with SAELens 6 to convert an older one)")
    version = metadata.get("sae_lens_version")
    major = str(version).split(".")[0]
    if not (isinstance(version, str) and major.isdigit() and int(major) >= 6):
        raise error(f"{source} says metadata.sae_lens_version {version!r:.40}: glassgpt reads "
                    f"SAELens 6's format (load and save it with SAELens 6 to convert it)")


def check_config(config: Any, source: str, error: ErrorType) -> None:
    """Every field of `config` is one SAELens could have written, or `error` naming it."""
    arch = find(config.architecture)
    if arch is None or not arch.loadable:
        hint = "" if arch is None else (f" (SAELens saves a trained {arch.title} SAE as "
                                        f"{arch.saved_as!r}; SAEConfig.{arch.name})")
        raise error(f"{source}: unknown architecture {config.architecture!r:.40}; glassgpt "
                    f"reads {', '.join(LOADABLE)}{hint}")
    for name in ("d_in", "d_sae"):
        _positive_int(getattr(config, name), f"{source}: {name}", error)
    _check_choices(config, source, error)
    if not isinstance(config.metadata, dict):
        raise error(f"{source}: metadata must be a JSON object, got "
                    f"{type(config.metadata).__name__}")
    _check_metadata(config.metadata, source, error)
    _check_architecture_fields(config, arch, source, error)
    if "k" in arch.cfg_fields:
        k = _positive_int(config.k, f"{source}: k", error)
        if k > config.d_sae:
            raise error(f"{source}: k = {k} latents of d_sae = {config.d_sae}")
        _boolean(config.rescale_acts_by_decoder_norm, f"{source}: rescale_acts_by_decoder_norm",
                 error)
    if arch.transcoder:
        _check_transcoder(config, source, error)


def _check_metadata(metadata: dict[str, Any], source: str, error: ErrorType) -> None:
    """The metadata fields glassgpt reads: a file that lies in one is refused here, when it is
    read, not later by whichever command uses the field."""
    for name in ("hook_name", "hook_name_out"):
        value = metadata.get(name)
        if value is not None and not (isinstance(value, str) and value):
            raise error(f"{source}: metadata.{name} must be a hook point's name, got "
                        f"{value!r:.60}")
    for name in ("model_name", TRAINED_ON_RUN, TRAINED_ON_WEIGHTS):
        value = metadata.get(name)
        if value is not None and not (isinstance(value, str) and value):
            raise error(f"{source}: metadata.{name} must be a name (a string), got "
                        f"{value!r:.60}")
    if metadata.get("context_size") is not None:
        _positive_int(metadata["context_size"], f"{source}: metadata.context_size", error)


def _check_architecture_fields(config: Any, arch: Architecture, source: str,
                               error: ErrorType) -> None:
    """k belongs to topk, d_out to transcoders: elsewhere it would be silently unused."""
    if "k" not in arch.cfg_fields and (config.k is not None
                                       or config.rescale_acts_by_decoder_norm):
        owners = [repr(other.name) for other in REGISTRY.values() if "k" in other.cfg_fields]
        raise error(f"{source}: k and rescale_acts_by_decoder_norm are fields of "
                    f"{' and '.join(owners)}, not of {config.architecture!r}")
    if not arch.transcoder and config.d_out is not None:
        raise error(f"{source}: d_out is a transcoder's field, not {config.architecture!r}'s")


def _check_choices(config: Any, source: str, error: ErrorType) -> None:
    if config.dtype not in DTYPES:
        raise error(f"{source}: dtype {config.dtype!r:.40} is none of {', '.join(DTYPES)}")
    try:
        torch.device(config.device)
    except (RuntimeError, TypeError):
        raise error(f"{source}: device {config.device!r:.40} is not a torch device") from None
    _boolean(config.apply_b_dec_to_input, f"{source}: apply_b_dec_to_input", error)
    if config.normalize_activations not in IDENTITY_NORMALIZATIONS:
        raise error(f"{source}: normalize_activations {config.normalize_activations!r:.40} is "
                    f"not supported; glassgpt reads {', '.join(IDENTITY_NORMALIZATIONS)} (the "
                    f"ones SAELens folds into the weights)")
    if config.reshape_activations not in RESHAPES:
        raise error(f"{source}: reshape_activations {config.reshape_activations!r:.40} is none "
                    f"of {', '.join(RESHAPES)}")


def _check_transcoder(config: Any, source: str, error: ErrorType) -> None:
    _positive_int(config.d_out, f"{source}: d_out", error)
    if config.apply_b_dec_to_input:
        raise error(f"{source}: a transcoder's b_dec is in its output space (d_out), so "
                    f"apply_b_dec_to_input must be false")
    if config.reshape_activations != "none":
        raise error(f"{source}: a transcoder reads whole vectors (reshape_activations 'none')")


def _positive_int(value: Any, what: str, error: ErrorType) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise error(f"{what} must be a positive integer, got {value!r:.40}")
    return int(value)


def _boolean(value: Any, what: str, error: ErrorType) -> None:
    if not isinstance(value, bool):
        raise error(f"{what} must be true or false, got {value!r:.40}")
