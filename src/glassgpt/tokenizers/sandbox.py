"""The Jinja environment chat templates render in: transformers' settings, in an immutable
sandbox that also bounds what one rendering may cost.

Jinja's sandbox keeps a template away from Python's internals, not from spending: a nested
`range` runs 10^10 steps, `10 ** (10 ** 8)` computes a 332-million-bit integer, `lipsum(10 **
6)`, `'x' * 10 ** 9` or `tojson(indent=10 ** 9)` fill memory. A template is code from whoever
published the model, so each rendering here has a budget (RenderLimits): a wall-clock
deadline, a size for any one string or list the template makes and for its output, a size for
its integers, and a total for all the text its steps make (garbage included).

Jinja runs a template as Python it generated, with no instruction counter to bound; so the
budget is checked wherever a template can spend:
  * the deadline at every loop item (the code generator routes each `for` through
    `loop_guard`), call, filter, operator, `~` and output piece;
  * before each step that can make much more than it is given (`*`, `**`, `+`, `%`, `~`,
    str.replace/join/format/expandtabs/translate, the join, replace, format, indent, wordwrap
    and urlize filters, `lipsum`, `strftime_now`, `tojson`, block output): an estimate of the
    result, so nothing huge is ever allocated;
  * after each call, filter and operator: the size of what it returned.
A value's size counts what printing it writes: a list holding one string a thousand times
counts that string a thousand times, so `[s] * 1000 | join` is refused before it is joined.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import wraps
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from glassgpt.errors import ConfigError, TokenizerError
from glassgpt.tokenizers import template_sizes as sizes

MAX_JSON_INDENT = 64  # tojson's indent is written once per nesting level on every line


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering may cost; far above any real chat prompt (a 128k-token context is
    about half a million characters, and published templates render in milliseconds).

    `chars` bounds the output and any one string or list the template makes; `made_chars` all
    the text (and list items) its steps make together, so that a template cannot keep many
    `chars`-sized values alive; `int_bits` its integers."""

    seconds: float = 10.0
    chars: int = 4 * 2**20
    made_chars: int = 256 * 2**20
    int_bits: int = 4096

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and self.chars > 0 and self.made_chars > 0
                and self.int_bits > 0):
            raise ConfigError(f"render limits must be positive, got {self}")


class TemplateLimitError(TokenizerError):
    """A chat template that ran past its RenderLimits."""


def bounded_environment(limits: RenderLimits) -> BoundedSandbox:
    """Jinja's immutable sandbox, set up as transformers sets up the one it renders with,
    bounded by `limits` from now on (the deadline starts here)."""
    environment = BoundedSandbox(
        limits, trim_blocks=True, lstrip_blocks=True,
        extensions=[_generation_tag(), jinja2.ext.loopcontrols, _TimedParsing])
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["namespace"] = _namespace_class()
    environment.globals["dict"] = _TemplateDict()
    return environment


LOOP_GUARD = "loop_guard"  # the environment's method each loop's items pass through


class _TimedParsing(jinja2.ext.Extension):
    """The deadline checked at every token a template is parsed from: a template of a
    million characters takes seconds to parse."""

    def filter_stream(self, stream: Any) -> Iterator[Any]:
        for token in stream:
            self.environment.tick()  # type: ignore[attr-defined]
            yield token


class _BoundingCodeGenerator(CodeGenerator):
    """Jinja's code generator, with the two places a template spends without calling
    anything routed through the environment (loop items, and `~`) routed through it, and
    the deadline checked at every node it writes."""

    def visit(self, node: jinja2.nodes.Node, *args: Any, **kwargs: Any) -> Any:
        self.environment.tick()  # type: ignore[attr-defined]
        return super().visit(node, *args, **kwargs)

    def visit_Template(self, node: jinja2.nodes.Template,  # noqa: N802 (Jinja's names)
                       frame: Any = None) -> None:
        # Before Jinja's own pass: every loop of the template, macros' and blocks' included.
        # (Jinja allows no new node types; a template's parser never makes an
        # EnvironmentAttribute, so this call is known for the guard in visit_Call.)
        for loop in node.find_all(jinja2.nodes.For):
            guard = jinja2.nodes.EnvironmentAttribute(LOOP_GUARD, lineno=loop.iter.lineno)
            loop.iter = jinja2.nodes.Call(guard, [loop.iter], [], None, None,
                                          lineno=loop.iter.lineno)
        super().visit_Template(node, frame)

    def visit_Call(self, node: jinja2.nodes.Call, frame: Any,  # noqa: N802
                   *, forward_caller: bool = False) -> None:
        if isinstance(node.node, jinja2.nodes.EnvironmentAttribute) and \
                node.node.name == LOOP_GUARD:  # called directly, not through the sandbox
            self.write(f"environment.{LOOP_GUARD}(")
            self.visit(node.args[0], frame)
            self.write(")")
            return
        super().visit_Call(node, frame, forward_caller=forward_caller)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:  # noqa: N802
        # Jinja joins `a ~ b` with markup_join or str_join; the same choice, passed on.
        if frame.eval_ctx.volatile:
            markup = "context.eval_ctx.volatile"
        else:
            markup = "True" if frame.eval_ctx.autoescape else "False"
        self.write("environment.joined_operands((")
        for operand in node.nodes:
            self.visit(operand, frame)
            self.write(", ")
        self.write(f"), {markup})")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a budget (see the module's docstring)."""

    code_generator_class = _BoundingCodeGenerator
    # `**` and `*` make huge integers and sequences, `+` long ones, `%` wide formatting.
    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def __init__(self, limits: RenderLimits, **options: Any) -> None:
        super().__init__(finalize=self._printed, **options)
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.made = 0
        self.filters = {name: self._bounded_filter(name, function)
                        for name, function in self.filters.items()}
        self.filters["tojson"] = jinja2.pass_context(
            lambda context, *args, **kwargs: self._tojson(*args, **kwargs))
        self.globals["lipsum"] = self._lipsum
        self.globals["strftime_now"] = self._strftime_now

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja renders a forbidden attribute as nothing; here it is refused outright.
        raise SecurityError(f"access to attribute {attribute!r:.40} of a "
                            f"{type(obj).__name__!r:.40} object is unsafe")

    # --- the budget ----------------------------------------------------------------------

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran longer than {self.limits.seconds:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.limits.chars:
            raise TemplateLimitError(f"{what} would make more than {self.limits.chars:,} "
                                     f"characters (or items)")

    def checked_result(self, value: Any, what: str) -> Any:
        """`value`, made by `what`, after its own size and the running total are checked."""
        if isinstance(value, int) and value.bit_length() > self.limits.int_bits:
            raise TemplateLimitError(f"{what} made a {value.bit_length():,}-bit integer (at "
                                     f"most {self.limits.int_bits:,} bits)")
        size = len(value) if isinstance(value, sizes.SIZED) else 1
        self.check_size(size, what)
        self.made += size
        if self.made > self.limits.made_chars:
            raise TemplateLimitError(f"its steps made more than {self.limits.made_chars:,} "
                                     f"characters in all")
        return value

    def check_arguments(self, what: str, args: Iterable[Any], kwargs: dict[str, Any]) -> None:
        """Numbers given to a call (a width, a count) at most `chars`; the text the arguments
        print, together, at most `chars`."""
        values = [*args, *kwargs.values()]
        for value in values:
            if isinstance(value, int) and abs(value) > self.limits.chars:
                raise TemplateLimitError(f"{what} was given {sizes.described_number(value)}; "
                                         f"numbers given to a call are at most "
                                         f"{self.limits.chars:,}")
        self.check_size(sizes.printed_size(values, self.limits.chars),
                        f"the arguments of {what}")

    def listed(self, items: Iterable[Any], what: str) -> list[Any]:
        """`items` as a list, made item by item within the budget (a lazy `map` may make a
        big string per item)."""
        listed, size = [], 0
        for item in items:
            self.tick()
            size += sizes.printed_size(item, self.limits.chars)
            self.check_size(size, what)
            listed.append(item)
        return listed

    def joined(self, pieces: Iterable[str], what: str) -> str:
        """The pieces of some output, joined, stopping once they pass `chars`."""
        kept, size = [], 0
        for piece in pieces:
            self.tick()
            size += len(piece)
            if size > self.limits.chars:
                raise TemplateLimitError(f"{what} passes {self.limits.chars:,} characters")
            kept.append(piece)
        return self.checked_result("".join(kept), what)

    # --- where a template spends ---------------------------------------------------------

    def loop_guard(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.tick()
            yield item

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        # Jinja joins a macro's, a {% set %} block's and a {% filter %} block's output here.
        return self.joined(pieces, "a block's output")

    def joined_operands(self, operands: tuple[Any, ...], markup: bool) -> str:
        self.tick()
        self.check_size(sizes.printed_size(operands, self.limits.chars), "`~`")
        return self.checked_result((markup_join if markup else str_join)(operands), "`~`")

    def _printed(self, value: Any) -> str:
        """Jinja's `finalize`: each `{{ ... }}` is sized before it is printed."""
        self.tick()
        self.check_size(sizes.printed_size(value, self.limits.chars), "printing a value")
        return self.checked_result(str(value), "printing a value")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        what = f"`{operator}`"
        if operator == "**":
            self._check_power(left, right)
        elif operator == "*" and sizes.is_int(left) and sizes.is_int(right):
            self._check_bits(left.bit_length() + right.bit_length(), what)
        elif operator == "*":
            self.check_size(sizes.repeated_size(left, right), what)
        elif operator == "+" and isinstance(left, sizes.SEQUENCES) and \
                isinstance(right, sizes.SEQUENCES):
            self.check_size(len(left) + len(right), what)
        elif operator == "%" and isinstance(left, str | bytes):
            self.check_size(sizes.percent_size(left, right, self.limits.chars), what)
        return self.checked_result(self.binop_table[operator](left, right), what)

    def _check_power(self, base: Any, exponent: Any) -> None:
        """Refuses `base ** exponent` when the integer it makes has more than `int_bits`
        bits, from the bits it would have, before anything is computed."""
        if not (sizes.is_int(base) and sizes.is_int(exponent)) or exponent <= 0 or abs(base) <= 1:
            return  # floats overflow or not by themselves; 0, 1, -1 stay small
        self._check_bits(base.bit_length() * exponent, "`**`")

    def _check_bits(self, bits: int, what: str) -> None:
        if bits > self.limits.int_bits:
            raise TemplateLimitError(f"{what} would make an integer of about "
                                     f"{sizes.described_number(bits)} bits (at most "
                                     f"{self.limits.int_bits:,})")

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.tick()
        what = "range" if obj is safe_range else \
            getattr(obj, "__name__", None) or type(obj).__name__
        method = sizes.text_method(obj)
        if method is not None and method[1] == "join" and args:
            args = (self.listed(args[0], "join"), *args[1:])
        if not isinstance(obj, Macro):  # a macro of the template's own only runs its code
            self.check_arguments(what, args, kwargs)
        if method is not None and method[1] in sizes.TEXT_METHOD_SIZES:
            self.check_size(sizes.TEXT_METHOD_SIZES[method[1]](method[0], *args, **kwargs), what)
        return self.checked_result(super().call(context, obj, *args, **kwargs), what)

    def _bounded_filter(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function` (a Jinja filter) with the budget checked around it. The wrapper takes
        the context, which also keeps Jinja from running it while it compiles a template
        (there it would be outside the budget)."""
        # What Jinja passes the filter first (@pass_context and its kin), by name.
        passed = getattr(getattr(function, "jinja_pass_arg", None), "name", None)
        estimate = sizes.FILTER_SIZES.get(name)

        @jinja2.pass_context
        @wraps(function)
        def bounded(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            self.tick()
            what = f"the {name} filter"
            if name in sizes.LISTED_FILTERS and isinstance(value, Iterator):
                value = self.listed(value, what)
            # A filter that only arranges its input (`messages | length`) prints none of it;
            # its result's size is checked.
            printed = args if name in sizes.ARRANGING_FILTERS else (value, *args)
            self.check_arguments(what, printed, kwargs)
            if estimate is not None:
                self.check_size(estimate(value, *args, **kwargs), what)
            first = {"context": (context,), "eval_context": (context.eval_ctx,),
                     "environment": (self,)}.get(passed, ())
            return self.checked_result(function(*first, value, *args, **kwargs), what)

        return bounded

    # --- transformers' globals and filters, bounded ---------------------------------------

    def _tojson(self, value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
                separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON, as
        # json.dumps writes it. Encoded piece by piece, so a huge result stops early.
        self.tick()
        self.check_arguments("tojson", (value, separators), {})
        width = indent if sizes.is_int(indent) else len(indent) if isinstance(indent, str) else 0
        if width > MAX_JSON_INDENT:
            raise TemplateLimitError(f"tojson's indent is {sizes.described_number(width)}; at most "
                                     f"{MAX_JSON_INDENT}")
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent,
                                   separators=separators, sort_keys=sort_keys)
        return self.joined(encoder.iterencode(value), "tojson")

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        # Words are at most 14 characters, a paragraph at most `max` of them, and its tags.
        self.check_size(sizes.non_negative(n) * (sizes.non_negative(max) * 16 + 32), "lipsum")
        return jinja2.utils.generate_lorem_ipsum(n, html, min, max)

    def _strftime_now(self, format: str) -> str:
        # A directive writes a few characters, or as many as a width in it says (glibc).
        self.check_size(16 * len(str(format)) + sizes.format_widths(str(format)), "strftime_now")
        return datetime.now().strftime(format)


# --- transformers' additions -----------------------------------------------------------------

class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, and nothing else of the class."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _namespace_class() -> type:
    """Jinja's namespace, refusing names that start with an underscore (a way into
    Python's internals), as transformers' does."""

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for name in values:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace attribute may not start with '_': {name!r:.40}")


def _generation_tag() -> type:
    """`{% generation %}...{% endgeneration %}`, which training templates use to mark the
    assistant's text: rendered as its body (marking is for training, not for sampling)."""

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag
