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
TokenizerError. Its rendering is bounded too (time, output, the sizes of what it makes: see
glassgpt.tokenizers.sandbox), and whatever it does wrong is one TokenizerError of one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from glassgpt.errors import TokenizerError

if TYPE_CHECKING:  # Jinja is imported when a template is rendered, not before
    from glassgpt.tokenizers.sandbox import RenderLimits

# The special tokens transformers passes to every template, by these names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
MAX_TEMPLATE_CHARS = 1_000_000  # published templates are a few kB; a huge one is refused
# What a template's own code can raise (its arithmetic, its indexing, a call it got wrong).
_TEMPLATE_FAILURES = (ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                      MemoryError)


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

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               limits: RenderLimits | None = None) -> str:
        """The text the model reads for `messages`, as transformers' `apply_chat_template(
        messages, tokenize=False, add_generation_prompt=...)` renders it, within `limits`."""
        return render_chat(self.template, messages, add_generation_prompt, self.special_tokens,
                           limits)


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
                special_tokens: dict[str, str] | None = None,
                limits: RenderLimits | None = None) -> str:
    """`template` rendered for `messages` in the bounded sandbox (glassgpt.tokenizers.sandbox).

    Whatever the template does wrong is one TokenizerError of one line: a syntax error,
    `raise_exception`, an unsafe attribute, its own arithmetic (a division by zero, a float
    overflow), recursion without end, or a step past `limits` (time, output, sizes; the
    defaults of RenderLimits when None)."""
    from glassgpt.tokenizers.sandbox import RenderLimits, TemplateLimitError, bounded_environment

    environment = bounded_environment(limits or RenderLimits())  # compiling counts too
    try:
        pieces = environment.from_string(template).generate(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **(special_tokens or {}))
        try:
            return environment.joined(pieces, "its output")
        finally:
            pieces.close()  # a template stopped halfway runs no further
    except TemplateLimitError as error:
        raise TokenizerError(f"the chat template was stopped: {_first_line(error)} (a "
                             f"template's rendering is bounded)") from None
    except Exception as error:
        failure = _template_failure(error)
        if failure is error:
            raise
        raise failure from None


def _template_failure(error: Exception) -> Exception:
    """A template's own failure as one TokenizerError, or `error` itself when it is not one
    a template can cause (a bug here keeps its traceback)."""
    import jinja2
    from jinja2.sandbox import SecurityError

    if isinstance(error, SecurityError):
        return TokenizerError(f"the chat template tried something the sandbox forbids "
                              f"({_first_line(error)}); it is not rendered")
    if isinstance(error, jinja2.TemplateError | SyntaxError):
        return TokenizerError(f"the chat template cannot be rendered: {_first_line(error)}")
    if isinstance(error, RecursionError):
        return TokenizerError("the chat template failed while rendering: it recursed "
                              "too deeply")
    if isinstance(error, _TEMPLATE_FAILURES):
        return TokenizerError(f"the chat template failed while rendering: "
                              f"{type(error).__name__}: {_first_line(error)}")
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
