"""The settings of a run's timeline (glassgpt.interp.timeline.timeline): torch-free, so that
`glassgpt timeline --help` lists them from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glassgpt.config import setting
from glassgpt.errors import InputError

OLSSON_LATE, OLSSON_EARLY, OLSSON_CONTEXT = 500, 50, 1024  # their token indices and context


@dataclass(frozen=True)
class TimelineSettings:
    """What `run_timeline` reads at each snapshot, and on what."""

    sequences: int = setting(64, "windows of each split the losses and the ICL score average "
                             "over (the same at every snapshot)")
    seed: int = setting(0, "seed of those windows, the head scores' tokens and the probe")
    icl_late: float = setting(OLSSON_LATE / OLSSON_CONTEXT, "the ICL score's late token, as a "
                              "fraction of the context (Olsson et al.'s 500 of 1024)")
    icl_early: float = setting(OLSSON_EARLY / OLSSON_CONTEXT, "the ICL score's early token, as "
                               "a fraction of the context (Olsson et al.'s 50 of 1024)")
    score_batch: int = setting(8, "repeated random sequences the head scores are read on")
    score_half: int | None = setting(None, "their repeated half (default: block_size // 2)")
    definition: str = setting("glassgpt", "the head scores' definition: glassgpt, arena or "
                              "transformer_lens (docs/interpretability.md)")
    probe: str | None = setting(None, "a prompt whose last token is the answer attributed to "
                                "the heads (default: random tokens written twice, less the last)")
    probe_half: int = setting(8, "the default probe's random tokens (written twice)")
    llc: bool = setting(False, "estimate the local learning coefficient at every snapshot "
                        "(SGLD, devinterp's estimator: slow)")
    llc_settings: Any = setting(None, "an LLCSettings (None: its defaults)")

    def __post_init__(self) -> None:
        if self.sequences < 1 or self.score_batch < 1 or self.probe_half < 1:
            raise InputError(f"sequences, score_batch and probe_half must be positive, got "
                             f"{self.sequences}, {self.score_batch}, {self.probe_half}")
        if not 0.0 <= self.icl_early < self.icl_late <= 1.0:
            raise InputError(f"icl_early and icl_late are fractions of the context with "
                             f"0 <= early < late <= 1, got {self.icl_early}, {self.icl_late}")
