"""Thread counts chosen by timing real steps; bf16 only where the CPU has the instructions."""

from __future__ import annotations

import itertools

import pytest
import torch

from glassgpt.errors import ConfigError
from glassgpt.machine import devices
from glassgpt.machine.threadsetting import parse_threads


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_steps(tuner: devices.ThreadTuner, seconds_at: dict[int, float], steps: int,
              compile_s: float = 0.0) -> list[int]:
    """Drive the tuner with steps whose duration depends on the thread count they ran with;
    the first step at each count takes `compile_s` more (a compiled graph's first step)."""
    used = []
    for _ in range(steps):
        tuner.before_step()
        threads = torch.get_num_threads()
        tuner.step_done(seconds_at[threads] + (compile_s if threads not in used else 0.0))
        used.append(threads)
    return used


def test_the_faster_count_is_chosen_after_a_warm_up_and_one_probe_each():
    tuner = devices.ThreadTuner(candidates=(1, 2), probe_steps=2)
    used = run_steps(tuner, {1: 0.01, 2: 0.06}, steps=9)  # two threads collapse: 6x slower
    # After the warm-up step (at one thread): each candidate twice, except that one step of
    # two threads 6x slower than one thread's is enough to drop the second.
    assert used[:5] == [1, 1, 1, 2, 1]
    assert used[5:] == [1, 1, 1, 1] and tuner.threads == 1 and tuner.probes == 1
    assert tuner.baseline == 0.01


def test_compiled_steps_leave_each_counts_first_step_untimed():
    """Under torch.compile a new thread count is a new graph: its first step is the compile."""
    tuner = devices.ThreadTuner(candidates=(1, 2), probe_steps=2, warm_up_each=True)
    used = run_steps(tuner, {1: 0.02, 2: 0.011}, steps=8, compile_s=30.0)
    assert used[:6] == [1, 1, 1, 2, 2, 2]  # each count: one compile, then two timed steps
    assert tuner._timings == {1: [0.02, 0.02], 2: [0.011, 0.011]}
    assert tuner.threads == 2 == torch.get_num_threads() and used[6:] == [2, 2]


def test_without_warm_ups_a_compile_in_the_probe_loses_its_count():
    """What `warm_up_each` prevents: the plain tuner drops the count whose step compiled."""
    tuner = devices.ThreadTuner(candidates=(1, 2), probe_steps=2)
    run_steps(tuner, {1: 0.02, 2: 0.011}, steps=6, compile_s=30.0)
    assert tuner.threads == 1


@pytest.mark.parametrize(("compiled", "warm_up_each"), [(True, True), (False, False)])
def test_tuner_for_asks_compiled_steps_for_warm_ups(monkeypatch, compiled, warm_up_each):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    tuner = devices.tuner_for("auto", torch.device("cpu"), compiled=compiled)
    assert tuner is not None and tuner.warm_up_each is warm_up_each


def test_all_cores_are_kept_when_they_are_faster():
    tuner = devices.ThreadTuner(candidates=(1, 2), probe_steps=2)
    run_steps(tuner, {1: 0.02, 2: 0.011}, steps=8)
    assert tuner.threads == 2 == torch.get_num_threads()


def test_steps_that_become_several_times_slower_start_a_new_probe():
    tuner = devices.ThreadTuner(candidates=(1, 2), probe_steps=1, degrade_factor=3.0, window=3)
    run_steps(tuner, {1: 0.05, 2: 0.01}, steps=6)  # 2 threads win: the machine is idle
    assert tuner.threads == 2 and tuner.probes == 1
    used = run_steps(tuner, {1: 0.012, 2: 0.08}, steps=8)  # then other work takes a core
    assert tuner.probes == 2 and tuner.threads == 1 and used[-1] == 1


def test_tuned_loops_time_every_item_and_keep_them_in_order(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(devices.time, "perf_counter", lambda: next(clock))
    tuner = devices.ThreadTuner(candidates=(1, 2), probe_steps=1)
    assert list(tuner.tuned(iter("abcdef"))) == list("abcdef")
    assert tuner.probes == 1


def test_one_candidate_means_no_probing():
    tuner = devices.ThreadTuner(candidates=(1,))
    assert run_steps(tuner, {1: 0.1, torch.get_num_threads(): 0.1}, steps=3)
    assert tuner.probes == 0


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("1", 1), (2, 2)])
def test_thread_settings_parse(value, expected):
    assert parse_threads(value) == expected


@pytest.mark.parametrize("value", ["0", "-3", "1000000", "many", "2.5"])
def test_bad_thread_settings_are_config_errors(value):
    with pytest.raises(ConfigError, match="threads must be"):
        parse_threads(value)


def test_bf16_support_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(devices.torch.cpu, "_is_avx512_bf16_supported", lambda: False,
                        raising=False)
    monkeypatch.setattr(devices.torch.cpu, "_is_amx_tile_supported", lambda: False,
                        raising=False)
    monkeypatch.setattr(devices, "_cpu_flags", lambda: {"avx2", "fma"})
    assert not devices.cpu_bf16_support()
    monkeypatch.setattr(devices, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert devices.cpu_bf16_support()


def test_bf16_slowdown_is_a_positive_ratio():
    assert devices.measure_bf16_slowdown(rows=4, width=16, rounds=2) > 0


def clock_of(durations: list[float]):
    """A clock whose successive (start, end) readings are `durations` apart."""
    readings = iter(itertools.accumulate(d for duration in durations for d in (0.0, duration)))
    return lambda: next(readings)


def test_bf16_slowdown_takes_the_best_alternated_round_and_never_times_the_warm_up():
    # (fp32, bf16) per round; bf16's first timed call 100x (a kernel built, a core taken)
    rounds = [(1.0, 100.0), (1.0, 0.9), (1.2, 0.95), (1.0, 0.9)]
    clock = clock_of([seconds for pair in rounds for seconds in pair])
    slowdown = devices.measure_bf16_slowdown(rows=2, width=8, rounds=4, clock=clock)
    assert slowdown == pytest.approx(0.9)


@pytest.mark.parametrize(("batch", "row", "expected"), [
    (0.4, 0.9, None),  # bf16 faster: nothing to say
    (1.3, 0.9, None),  # within a shared host's noise: not "clearly slower"
    (12.7, 3.0, "a bf16 matmul measured 12.7x slower than float32 here; use --dtype float32"),
    (12.7, 0.8, "a bf16 matmul measured 12.7x slower than float32 here; use --dtype float32 "
                "to train (one row at a time, as each sampled token is, it measured 0.8x: "
                "sampling in bf16 may still pay)"),
])
def test_bf16_warning_only_when_bf16_measured_clearly_slower(monkeypatch, batch, row, expected):
    monkeypatch.setattr(devices, "cpu_bf16_support", lambda: False)
    monkeypatch.setattr(devices, "bf16_slowdown", lambda: batch)
    monkeypatch.setattr(devices, "bf16_row_slowdown", lambda: row)
    warning = devices.bf16_warning(torch.device("cpu"))
    if expected is None:
        assert warning is None
    else:
        assert warning.endswith(expected)


def test_a_warm_up_outlier_gives_no_warning(monkeypatch):
    """The first bf16 call 150x slower, every later one faster than float32: no warning."""
    rounds = [(1.0, 150.0)] + [(1.0, 0.8)] * 6
    clock = clock_of([seconds for pair in rounds for seconds in pair])
    measured = devices.measure_bf16_slowdown
    monkeypatch.setattr(devices, "cpu_bf16_support", lambda: False)
    monkeypatch.setattr(devices, "bf16_slowdown", lambda: measured(rows=2, width=8, rounds=7,
                                                                   clock=clock))
    assert devices.bf16_warning(torch.device("cpu")) is None
