"""glassgpt.machine.memory.return_large_buffers: freed large buffers go back to the OS instead
of staying in glibc's heap (what keeps a LoRA fine-tune's peak near its weights)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import sys, torch
    from glassgpt.machine.memory import return_large_buffers
    if sys.argv[1] == "set":
        assert return_large_buffers()
    first = torch.ones(10 * 2**18)  # 10 MiB, freed: glibc's own threshold rises past 8 MiB
    del first
    buffers = [torch.ones(2 * 2**20) for _ in range(20)]  # 20 x 8 MiB
    kept = buffers[1::2]  # every other one freed: holes no heap trim can give back
    del buffers
    with open("/proc/self/statm") as f:
        print(int(f.read().split()[1]) * 4096 / 2**20)
""")


def resident_mib(setting: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROGRAM, setting], capture_output=True,
                          text=True, check=True)
    return float(done.stdout)



def on_glibc() -> bool:
    import ctypes

    return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None),
                                                        "gnu_get_libc_version")


@pytest.mark.slow
@pytest.mark.skipif(not on_glibc(), reason="glibc's malloc and /proc: elsewhere nothing is set")
def test_freed_buffers_leave_the_process() -> None:
    # The ten freed 8 MiB buffers: resident by default, given back with the threshold fixed.
    assert resident_mib("default") - resident_mib("set") > 60
