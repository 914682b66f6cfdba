"""`glassgpt timeline RUN`: parse the flags, call glassgpt.interp.timeline.timeline
(`timeline_of_run`), print what each snapshot showed and where the file is."""

from __future__ import annotations

import argparse
from typing import Any

from glassgpt.cli.common import DefaultsHelpFormatter, add_settings_flags, path_arg, say
from glassgpt.interp.timeline.settings import TimelineSettings

# flag -> TimelineSettings field (the LLC's own settings keep their defaults: LLCSettings)
SETTINGS = {name: name for name in ("sequences", "seed", "icl_late", "icl_early", "score_batch",
                                    "score_half", "definition", "probe", "probe_half", "llc")}


class _Store(argparse.Action):
    """A value, or True for a switch (which takes none)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "timeline", formatter_class=DefaultsHelpFormatter,
        help="what a run's snapshots show, step by step (train --snapshots N)",
        description="Read every snapshot of RUN (glassgpt train --snapshots N): the train and "
        "val loss, the in-context learning score (Olsson et al.'s, adapted to the context), "
        "every head's previous-token, duplicate-token and induction score, a probe's logit "
        "attribution by head, and with --llc the local learning coefficient; written to "
        "RUN/timeline.json (and RUN/timeline.png with --plot).")
    p.add_argument("run_dir", type=path_arg, metavar="RUN", help="a run trained with "
                   "--snapshots")
    p.add_argument("--data", type=path_arg, help="prepared data directory the losses are read "
                   "on (default: the run's own)")
    p.add_argument("--plot", action="store_true", help="draw RUN/timeline.png: the loss with "
                   "the phase change marked, the induction scores and the LLC, one time axis")
    p.add_argument("--device", default="cpu", help="device to read the snapshots on")
    add_settings_flags(p, TimelineSettings, SETTINGS, _Store,
                       choices={"definition": ("glassgpt", "arena", "transformer_lens")})
    p.set_defaults(handler=run_timeline_command)


def run_timeline_command(args: argparse.Namespace) -> int:
    from glassgpt.cli.common import step_bar
    from glassgpt.interp.timeline.timeline import timeline_of_run
    from glassgpt.rundir.snapshots import list_snapshots

    settings = TimelineSettings(**{field: getattr(args, flag) for flag, field in
                                   SETTINGS.items()})
    steps = list_snapshots(args.run_dir)
    if steps:
        llc = ", the LLC by SGLD at each (slow)" if settings.llc else ""
        say(f"timeline of {args.run_dir}: {len(steps)} snapshots (steps {steps[0]} to "
            f"{steps[-1]}), losses on {settings.sequences} windows of each split{llc}")
    with step_bar("timeline", "snapshots") as bar:
        bar.begin(len(steps))
        timeline, written = timeline_of_run(args.run_dir, settings, args.data, args.plot,
                                             args.device, lambda done, _: bar.advance(done))
    for line in summary_lines(timeline):
        print(line)
    say(f"written: {', '.join(str(path) for path in written)}")
    return 0


def summary_lines(timeline: Any) -> list[str]:
    """One line a snapshot: its losses, ICL score, best induction head (and LLC), then the
    phase change."""
    from glassgpt.interp.timeline.timeline import PHASE_CHANGE_MIN

    lines = []
    for record, best in zip(timeline.records, timeline.best_induction(), strict=True):
        losses = ", ".join(f"{split} loss {record[f'{split}_loss']:.4f}"
                           for split in timeline.splits)
        llc = f", LLC {record['llc']['llc_mean']:.4g}" if "llc" in record else ""
        lines.append(f"step {record['step']:>7}: {losses}, ICL score "
                     f"{record['icl_score']:+.4f}, best induction score {best:.3f}{llc}")
    phase = timeline.phase_change()
    lines.append(f"phase change (best induction score half way up) at step {phase}"
                 if phase is not None else f"no phase change: the best induction score moved "
                 f"less than {PHASE_CHANGE_MIN}")
    return lines
