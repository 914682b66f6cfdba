"""Chat templates: the Jinja template an instruct model's tokenizer ships, rendered as
transformers renders it, in a sandbox.

A chat template turns messages ([{"role": "user", "content": "Hi"}]) into the one string the
model was fine-tuned on ("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"). It comes
from the model's tokenizer_config.json (`chat_template`) or chat_template.jinja, and is kept in an
imported run as `ChatTemplate` (storage.layout.CHAT_TEMPLATE_FILE): the template, the special
tokens it may name (`bos_token`, `eos_token`, ...) and the token that ends a turn, where
sampling stops.

A template is code from whoever published the model, so it runs in Jinja's
ImmutableSandboxedEnvironment with transformers' settings (trim_blocks, lstrip_blocks, loop
controls, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`), so the same
messages give the same string; an attempt to reach Python's internals
(`''.__class__.__mro__`, which Jinja alone would render as nothing) fails as one
TokenizerError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from glassgpt.errors import TokenizerError

# The special tokens transformers passes to every template, by these names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
MAX_TEMPLATE_CHARS = 1_000_000  # published templates are a few kB; a huge one is refused


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template, the special tokens it may use, and `end_of_turn`: the
    token an assistant turn ends with (the tokenizer's eos_token, `<|im_end|>` for Qwen3 and
    SmolLM2), where a reply stops."""

    template: str
    end_of_turn: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"chat_template": self.template, "end_of_turn": self.end_of_turn,
                           "special_tokens": self.special_tokens}, indent=2) + "\n"

    @classmethod
    def from_json(cls, data: Any, source: str) -> ChatTemplate:
        """The ChatTemplate `to_json` wrote, each field type-checked (`data` parsed already)."""
        if not isinstance(data, dict):
            raise TokenizerError(f"{source}: a chat template file is a JSON object")
        template, end = data.get("chat_template"), data.get("end_of_turn")
        special = data.get("special_tokens", {})
        if not isinstance(template, str) or not (end is None or isinstance(end, str)):
            raise TokenizerError(f"{source}: chat_template must be a string and end_of_turn "
                                 f"a string or null")
        if not (isinstance(special, dict) and all(isinstance(v, str) for v in special.values())
                and set(special) <= set(SPECIAL_TOKEN_NAMES)):
            raise TokenizerError(f"{source}: special_tokens must map "
                                 f"{', '.join(SPECIAL_TOKEN_NAMES)} to strings")
        return cls(checked_template(template, source), end, special)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The text the model reads for `messages`, as transformers' `apply_chat_template(
        messages, tokenize=False, add_generation_prompt=...)` renders it."""
        return render_chat(self.template, messages, add_generation_prompt, self.special_tokens)


def checked_template(template: str, source: str) -> str:
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TokenizerError(f"{source}: the chat template has {len(template):,} characters; "
                             f"at most {MAX_TEMPLATE_CHARS:,} are read")
    return template


def chat_messages(message: str, system: str | None = None) -> list[dict[str, str]]:
    """One user message, after a system message when given."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    return [*messages, {"role": "user", "content": message}]


def render_chat(template: str, messages: list[dict[str, str]],
                add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None) -> str:
    """`template` rendered for `messages` in the sandbox; a template that fails (a syntax
    error, `raise_exception`, an unsafe attribute) is one TokenizerError."""
    import jinja2
    from jinja2.sandbox import SecurityError

    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt,
                               **(special_tokens or {}))
    except SecurityError as error:
        raise TokenizerError(f"the chat template tried something the sandbox forbids "
                             f"({_first_line(error)}); it is not rendered") from None
    except jinja2.TemplateError as error:
        raise TokenizerError(f"the chat template cannot be rendered: "
                             f"{_first_line(error)}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as error:
        raise TokenizerError(f"the chat template failed while rendering: "
                             f"{type(error).__name__}: {_first_line(error)}") from None


def _environment() -> Any:
    """Jinja's immutable sandbox, set up as transformers sets up the one it renders with."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # Jinja renders a forbidden attribute as nothing; here it is refused outright.
            raise SecurityError(f"access to attribute {attribute!r:.40} of a "
                                f"{type(obj).__name__!r:.40} object is unsafe")

    environment = Sandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    environment.globals["namespace"] = _namespace_class()
    environment.globals["dict"] = _TemplateDict()
    return environment


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, and nothing else of the class."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2
    raise jinja2.TemplateError(message)


def _namespace_class() -> type:
    """Jinja's namespace, refusing names that start with an underscore (a way into
    Python's internals), as transformers' does."""
    import jinja2.utils

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
    from jinja2.sandbox import SecurityError
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace attribute may not start with '_': {name!r:.40}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _generation_tag() -> type:
    """`{% generation %}...{% endgeneration %}`, which training templates use to mark the
    assistant's text: rendered as its body (marking is for training, not for sampling)."""
    import jinja2.ext
    import jinja2.nodes

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
