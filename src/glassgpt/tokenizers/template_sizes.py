"""How big what a chat template makes would be, estimated before it is made (see
glassgpt.tokenizers.sandbox, which refuses a step whose estimate passes its limits).

Each estimate is an upper bound, in characters (or items), of a result that can be much bigger
than what it is made from: a string's `replace` and `join`, a width in `format` or `%`, a
filter's padding. `printed_size` is what printing a value writes, counting a string as often
as a list holds it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, ItemsView, KeysView, ValuesView
from typing import Any

import jinja2.utils

# --- sizes ---------------------------------------------------------------------------------

SEQUENCES = (str, bytes, list, tuple)
SIZED = (str, bytes, list, tuple, dict, set, frozenset)
CONTAINERS = (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)
DIGITS = re.compile(r"\d+")
# A %-conversion: mapping key, flags, width, precision, length, type.
PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?.", re.S)


def printed_size(value: Any, budget: int) -> int:
    """About how many characters printing `value` writes (an upper bound, up to the escapes
    of a string's repr), counted only until the count passes `budget`: walking stops there,
    so a list of a million references to one list costs no more than `budget` steps."""
    size, pending = 0, [value]
    while pending and size <= budget:
        item = pending.pop()
        if isinstance(item, str | bytes):
            size += len(item) + 2
        elif isinstance(item, bool) or item is None:
            size += 5
        elif isinstance(item, int):
            size += item.bit_length() // 3 + 2
        elif isinstance(item, range):
            size += 2 + len(item) * (len(str(max(abs(item.start), abs(item.stop)))) + 3)
        elif isinstance(item, dict | jinja2.utils.Namespace):
            mapping = item if isinstance(item, dict) else \
                object.__getattribute__(item, "_Namespace__attrs")
            size += 2 + 4 * len(mapping)
            if size <= budget:
                pending.extend(mapping.keys())
                pending.extend(mapping.values())
        elif isinstance(item, CONTAINERS):
            size += 2 + 2 * len(item)
            if size <= budget:
                pending.extend(item)
        else:  # a float, an Undefined, a loop, a macro: a short repr
            size += 64
    return size


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def described_number(value: int) -> str:
    """An integer for a message: its digits when short, else its size."""
    return f"{value:,}" if value.bit_length() <= 64 else f"a {value.bit_length():,}-bit number"


def non_negative(value: Any) -> int:
    return max(value, 0) if is_int(value) else 0


def format_widths(spec: str) -> int:
    """The widths and precisions written in a format string, summed: what they may pad to."""
    return sum(int(d) if len(d) < 12 else 10**12 for d in DIGITS.findall(spec))


def repeated_size(left: Any, right: Any) -> int:
    """How long `left * right` is when one side is a sequence and the other a count."""
    sequence, times = (left, right) if isinstance(left, SEQUENCES) else (right, left)
    if isinstance(sequence, SEQUENCES) and isinstance(times, int):
        return len(sequence) * max(times, 0)
    return 0


def percent_size(template: str | bytes, values: Any, budget: int) -> int:
    """What `template % values` writes, at most: the template, the values printed, and the
    widths it asks for (from `*` in it, the numbers among the values)."""
    text = template.decode("latin-1") if isinstance(template, bytes) else template
    size = len(text) + printed_size(values, budget)
    for width, precision in PERCENT_SPEC.findall(text):
        size += format_widths(width + " " + precision)
        if "*" in (width, precision):
            listed = values if isinstance(values, tuple) else (values,)
            size += sum(abs(v) for v in listed if is_int(v))
    return size


def format_size(template: str, *args: Any, **kwargs: Any) -> int:
    """What `template.format(*args, **kwargs)` writes, at most (a nested `{:{width}}` may
    take its width from any integer argument)."""
    size = len(template) + printed_size([args, kwargs], 2**62)
    for _, _, spec, _ in string.Formatter().parse(template):
        size += format_widths(spec or "")
        if spec and "{" in spec:
            size += sum(abs(v) for v in [*args, *kwargs.values()] if is_int(v))
    return size


def format_map_size(template: str, mapping: Any = None) -> int:
    return format_size(template, **mapping) if isinstance(mapping, dict) else len(template)


def replace_size(text: Any, old: Any = "", new: Any = "", count: Any = -1) -> int:
    if not (isinstance(text, str | bytes) and type(old) is type(new) is type(text)):
        return 0  # the call itself refuses the mismatch
    found = len(text) + 1 if not old else text.count(old)
    if is_int(count) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def join_size(separator: Any, items: Any = ()) -> int:
    separator_size = len(separator) if isinstance(separator, str | bytes) else 0
    count = len(items) if isinstance(items, (*SIZED, range)) else 0
    return printed_size(items, 2**62) + separator_size * count


def expandtabs_size(text: str | bytes, tabsize: Any = 8) -> int:
    tab = "\t" if isinstance(text, str) else b"\t"
    return len(text) + text.count(tab) * non_negative(tabsize)  # type: ignore[arg-type]


def translate_size(text: str | bytes, table: Any = None) -> int:
    longest = max((len(v) for v in table.values() if isinstance(v, str | bytes)), default=1) \
        if isinstance(table, dict) else 1
    return len(text) * max(longest, 1)


# str and bytes methods whose result can be much bigger than their arguments.
TEXT_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "replace": replace_size, "join": join_size, "expandtabs": expandtabs_size,
    "format": format_size, "format_map": format_map_size, "translate": translate_size}


def text_method(obj: Any) -> tuple[str | bytes, str] | None:
    """(the string, the method's name) when `obj` is a bound str or bytes method (or the
    sandbox's wrapper of str.format), else None."""
    method = getattr(obj, "__wrapped__", obj)
    owner = getattr(method, "__self__", None)
    if isinstance(owner, str | bytes):
        return owner, getattr(method, "__name__", "")
    return None


# Filters that read their whole input: a lazy input (a `map`) is made a list first, within
# the budget, so that its size is known before they run.
LISTED_FILTERS = frozenset({"join", "sum", "list", "sort", "unique", "reverse", "groupby",
                             "min", "max"})
# Filters that arrange their input without printing it; their results are sized.
ARRANGING_FILTERS = frozenset({"length", "count", "first", "last", "default", "d", "list",
                                "map", "select", "reject", "selectattr", "rejectattr", "batch",
                                "slice", "sort", "unique", "reverse", "random", "min", "max",
                                "items", "dictsort", "groupby", "attr"})
def _indent_size(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> int:
    lines = str(s).count("\n") + 1
    return len(str(s)) + lines * (len(width) if isinstance(width, str) else non_negative(width))


def _wordwrap_size(s: Any, width: Any = 79, break_long_words: bool = True,
                   wrapstring: Any = None, break_on_hyphens: bool = True) -> int:
    return (len(str(s)) + 1) * (1 + len(str(wrapstring or "\n")))  # a break after each


def _urlize_size(value: Any, trim_url_limit: Any = None, nofollow: bool = False,
                 target: Any = None, rel: Any = None, extra_schemes: Any = None) -> int:
    # A link written around each word, its target and rel attributes in each.
    return (len(str(value)) + 1) * (16 + len(str(target or "")) + len(str(rel or "")))


# Filters whose result can be much bigger than their input, by the filter's own arguments
# (each estimate takes the filter's parameters).
FILTER_SIZES: dict[str, Callable[..., int]] = {
    "join": lambda value, d="", attribute=None: join_size(str(d), value),
    "replace": lambda s, old, new, count=None: replace_size(
        str(s), str(old), str(new), -1 if count is None else count),
    "format": lambda value, *args, **kwargs: percent_size(str(value), kwargs or args, 2**62),
    "indent": _indent_size, "wordwrap": _wordwrap_size, "urlize": _urlize_size}
