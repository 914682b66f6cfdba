"""A chat template's rendering is bounded (issue 38, item 5): a hostile template (one that
spins, grows a huge integer, string or output, or recurses) stops within its RenderLimits as
one TokenizerError of one line, and so does a template's own error (a division by zero, a
float overflow); none hangs, and none takes the interpreter down."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glassgpt.errors import TokenizerError
from glassgpt.tokenizers.chat import chat_messages, render_chat
from glassgpt.tokenizers.sandbox import RenderLimits

# Small enough that each case costs at most a fifth of a second.
LIMITS = RenderLimits(seconds=0.2)
STOPPED = "the chat template was stopped: "
FAILED = "the chat template failed while rendering: "
RANGE = "range(100000)"

HOSTILE = {
    "a nested range of 10^10 steps": (
        f"{{% for i in {RANGE} %}}{{% for j in {RANGE} %}}{{% endfor %}}{{% endfor %}}",
        STOPPED + "it ran longer than 0.2 s"),
    "a nested loop that calls nothing": (
        f"{{% set r = {RANGE} | list %}}{{% for i in r %}}{{% for j in r %}}{{% endfor %}}"
        f"{{% endfor %}}", STOPPED + "it ran longer than 0.2 s"),
    "10 ** (10 ** 8)": ("{{ 10 ** (10 ** 8) }}", STOPPED + "`**` would make an integer"),
    "2 ** (2 ** 40)": ("{{ 2 ** (2 ** 40) }}", STOPPED + "`**` would make an integer"),
    "squaring in a loop": (
        "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}{{ ns.n }}", STOPPED + "`*` would make an integer"),
    "a string repeated 10^9 times": ("{{ 'x' * 10 ** 9 }}", STOPPED + "`*` would make more"),
    "a string doubled by ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}", STOPPED + "`~` would make more"),
    "a string doubled by +": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}", STOPPED + "`+` would make more"),
    "replace's square": ("{{ ('x' * 100000).replace('x', 'x' * 100000) }}",
                         STOPPED + "replace would make more"),
    "one string joined 10^5 times": ("{{ (['x' * 100000] * 100000) | join }}",
                                     STOPPED + "the arguments of the join filter"),
    "a width of 10^9": ("{{ '{:>1000000000}'.format(1) }}", STOPPED + "format would make more"),
    "a %-width of 10^9": ("{{ '%1000000000d' % 1 }}", STOPPED + "`%` would make more"),
    "a padding of 10^10": ("{{ 'x'.ljust(10 ** 10) }}", STOPPED + "ljust was given 10,000,"),
    "tojson(indent=huge)": ("{{ messages | tojson(indent=10 ** 9) }}",
                            STOPPED + "tojson's indent is 1,000,000,000"),
    "lipsum(1e6)": ("{{ lipsum(1000000) }}", STOPPED + "lipsum would make more"),
    # Either bound may come first: the steps on a quiet machine, the clock on a loaded one (a
    # clean-clone CI run beside four busy processes ran out of the 0.2 s first).
    "a block that outputs 10^11 characters": (
        f"{{% set x %}}{{% for i in {RANGE} %}}{{{{ 'y' * 1000000 }}}}{{% endfor %}}{{% endset %}}",
        (STOPPED + "its steps made more than", STOPPED + "it ran longer than 0.2 s")),
    "a range that ends at 10^12": ("{{ range(10 ** 12) | list }}",
                                   STOPPED + "range was given 1,000,000,000,000"),
    "a range past Jinja's": ("{{ range(200000) | list }}", FAILED + "OverflowError: Range too"),
    "a division by zero": ("{{ 1 // 0 }}", FAILED + "ZeroDivisionError"),
    "a float overflow": ("{{ 10.0 ** 400 }}", FAILED + "OverflowError"),
    "endless recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                          FAILED + "it recursed too deeply"),
}


# Each aborted the interpreter before (rc -6); rendered with the default limits.
CRASHES = {
    "30 MB of output": ("{% for i in range(30000) %}{{ 'x' * 1000 }}{% endfor %}",
                        STOPPED + "its output passes 4,194,304 characters"),
    "lipsum(1e6), by default": ("{{ lipsum(1000000) }}", STOPPED + "lipsum would make more"),
}
# All the cases run in one child whose memory is capped: a regression fails there, within
# the timeout, and can take neither pytest nor the machine down.
CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
from glassgpt.errors import TokenizerError
from glassgpt.tokenizers.chat import chat_messages, render_chat
from glassgpt.tokenizers.sandbox import RenderLimits
for name, (template, seconds) in json.loads(sys.argv[1]).items():
    start = time.perf_counter()
    try:
        render_chat(template, chat_messages("hi"),
                    limits=None if seconds is None else RenderLimits(seconds=seconds))
        outcome = "rendered"
    except TokenizerError as error:
        outcome = str(error)
    except BaseException as error:
        outcome = f"{type(error).__name__}: {error}"[:300]
    print(json.dumps([name, outcome, time.perf_counter() - start]), flush=True)
"""


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[str, float]]:
    """Each case's error message (or "rendered") and seconds, from one child process."""
    cases = {**{name: (template, LIMITS.seconds) for name, (template, _) in HOSTILE.items()},
             **{name: (template, None) for name, (template, _) in CRASHES.items()}}
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)],
                             capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired as timeout:  # the cases that finished still count
        out = (timeout.stdout or b"").decode()
    return {name: (outcome, seconds) for name, outcome, seconds in map(json.loads,
                                                                       out.splitlines())}


@pytest.mark.parametrize("name", [*HOSTILE, *CRASHES])
def test_a_hostile_template_stops_within_its_limits_as_one_line(
        name: str, outcomes: dict[str, tuple[str, float]]) -> None:
    _, message = HOSTILE.get(name) or CRASHES[name]
    assert name in outcomes, "the case did not finish (it hung, or took the child down)"
    outcome, seconds = outcomes[name]
    assert outcome.startswith(message) and "\n" not in outcome
    assert seconds < 2


def test_a_template_is_stopped_in_this_process_too() -> None:
    with pytest.raises(TokenizerError, match="it ran longer than 0.2 s"):
        render_chat(HOSTILE["a nested range of 10^10 steps"][0], chat_messages("hi"),
                    limits=LIMITS)


def test_limits_are_positive() -> None:
    from glassgpt.errors import ConfigError
    with pytest.raises(ConfigError, match="positive"):
        RenderLimits(seconds=0)
