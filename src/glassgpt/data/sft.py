"""Conversations for supervised fine-tuning (SFT): read, rendered, and trained on the assistant
only.

A conversation file is JSONL, one conversation a line:

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

Roles are system, user and assistant. Each conversation is rendered through the run's own chat
template (the one `sample --chat` uses), and the loss mask is true exactly on the assistant's
tokens: its content and its end-of-turn marker. The assistant's spans are found by diffing
renderings, not by knowing any template: the text before assistant message i is the rendering of
the messages before it with the generation prompt (what `sample --chat` feeds the model), and its
end is where the rendering of the messages up to it ends. Templates that render a final
assistant turn otherwise than an earlier one (Qwen3 adds an empty think block to the last) are
read up to the template's end-of-turn marker instead. Text after the end-of-turn marker within
the span (the template's own newline) is not trained: a reply ends at the marker.

Each segment (the text between spans, each span) is encoded on its own, as `sample --chat`
encodes its prompt and the model then writes the reply: the ids at every span's start are those
the model meets when it chats.

A run with no chat template (trained here, char or BPE) gets glassgpt's own SIMPLE_TEMPLATE:

    <|system|>\\n...\\n<|user|>\\n...\\n<|assistant|>\\n...<|end|>\\n

rendered with the run's tokenizer, whose vocabulary must hold its characters (a char
tokenizer's must; byte-level BPE encodes anything).

Packing: the conversations are concatenated into one stream of ids with the mask carried, and
training draws random windows of block_size + 1 tokens from it as `train` draws from a corpus
(`ConversationSampler`), only windows that hold at least one trained target. A window may span
two conversations (the second attends to the end of the first): the usual packing trade-off,
which wastes no compute on padding. A stream shorter than one window is padded with untrained
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from glassgpt.errors import DataError, InputError, TokenizerError
from glassgpt.storage import files
from glassgpt.tokenizers import Tokenizer
from glassgpt.tokenizers.chat import ChatTemplate

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content")
MAX_SFT_BYTES = 1 << 30  # a conversation file is read whole; a larger one is refused
IGNORED = -1  # a target the model's loss skips
# glassgpt's own chat format, for a run whose tokenizer came with no template.
SIMPLE_END_OF_TURN = "<|end|>"
SIMPLE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|end|>\\n' }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def simple_template() -> ChatTemplate:
    """glassgpt's own template, for a run with none (see the module's docstring)."""
    return ChatTemplate(SIMPLE_TEMPLATE, SIMPLE_END_OF_TURN)


# --- reading ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    line: int  # where it is in its file, for messages
    messages: list[dict[str, str]]


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file; any line that is not one raises InputError naming
    the file and the line. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"conversation file not found: {path}")
    text = files.read_text(path, MAX_SFT_BYTES, InputError)
    conversations = [Conversation(number, check_conversation(data, f"{path}:{number}"))
                     for number, data in files.parse_json_lines(text, lambda n: f"{path}:{n}",
                                                                InputError)]
    if not conversations:
        raise InputError(f"{path} holds no conversation (one JSON object a line: "
                         f'{{"messages": [{{"role": "user", "content": "..."}}, ...]}})')
    return conversations


def parse_line(line: str, where: str) -> list[dict[str, str]]:
    """The messages of one JSONL line, each checked; `where` ("file:line") names it."""
    return check_conversation(files.parse_json(line, where, InputError), where)


def check_conversation(data: object, where: str) -> list[dict[str, str]]:
    """The messages of one line's JSON value, each checked; `where` ("file:line") names it."""
    if not isinstance(data, dict) or set(data) != {"messages"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise InputError(f"{where}: expected an object with only a 'messages' list, got "
                         f"{keys}")
    messages = data["messages"]
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: 'messages' must be a non-empty list of "
                         f"{{'role', 'content'}} objects")
    return [check_message(message, f"{where}: message {i + 1}")
            for i, message in enumerate(messages)]


def check_message(message: object, where: str) -> dict[str, str]:
    if not isinstance(message, dict) or set(message) != set(MESSAGE_KEYS):
        keys = sorted(message) if isinstance(message, dict) else type(message).__name__
        raise InputError(f"{where} must have exactly the keys role and content, got {keys}")
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise InputError(f"{where} has role {role!r:.40}; roles are {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise InputError(f"{where}: content must be a string, got "
                         f"{type(content).__name__}")
    return {"role": role, "content": content}


# --- rendering and masking ---------------------------------------------------------------------

@dataclass
class Example:
    """One conversation as token ids and, per id, whether it is trained (an assistant's)."""

    line: int
    ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)


def assistant_spans(chat: ChatTemplate, messages: list[dict[str, str]]
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the (start, end) characters of each assistant reply in
    it: its content and end-of-turn marker (see the module's docstring for how they are
    found). A template whose renderings give no span is refused (TokenizerError)."""
    full = chat.render(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.render(messages[:i], add_generation_prompt=True)
        if not full.startswith(before):
            raise _no_span("the text before an assistant reply is not where the whole "
                           "conversation's rendering has it")
        end = _reply_end(chat, messages[:i + 1], full, len(before))
        spans.append((len(before), _cut_at_end_of_turn(full, len(before), end, chat)))
    return full, spans


def _reply_end(chat: ChatTemplate, upto: list[dict[str, str]], full: str, start: int) -> int:
    """Where the reply that starts at `start` ends in `full`."""
    through = chat.render(upto, add_generation_prompt=False)
    if full.startswith(through) and len(through) > start:
        return len(through)
    # The last turn rendered otherwise (Qwen3's think block): read up to the end-of-turn mark.
    marker = chat.end_of_turn
    at = -1 if not marker else full.find(marker, start)
    if at < 0:
        raise _no_span("an assistant reply rendered alone differs from its place in the "
                       "whole conversation, and no end-of-turn marker follows it")
    return at + len(marker)


def _cut_at_end_of_turn(full: str, start: int, end: int, chat: ChatTemplate) -> int:
    """`end`, or just after the span's last end-of-turn marker: what follows it (a newline)
    is the template's, not the reply's."""
    marker = chat.end_of_turn
    at = -1 if not marker else full.rfind(marker, start, end)
    return end if at < 0 else at + len(marker)


def _no_span(why: str) -> TokenizerError:
    return TokenizerError(f"cannot find the assistant's replies in this chat template's "
                          f"output: {why}; it cannot be used for fine-tuning on conversations")


def encode_conversation(conversation: Conversation, chat: ChatTemplate,
                        tokenizer: Tokenizer) -> Example:
    """The ids of the rendered conversation, and which are trained (the assistant's)."""
    try:
        text, spans = assistant_spans(chat, conversation.messages)
        example = Example(conversation.line)
        cut = 0
        for start, end in spans:
            _add(example, tokenizer, text[cut:start], trained=False)
            _add(example, tokenizer, text[start:end], trained=True)
            cut = end
        _add(example, tokenizer, text[cut:], trained=False)
    except TokenizerError as error:
        raise TokenizerError(f"conversation at line {conversation.line}: {error}") from None
    return example


def _add(example: Example, tokenizer: Tokenizer, text: str, trained: bool) -> None:
    if text:
        ids = tokenizer.encode(text)
        example.ids.extend(ids)
        example.trained.extend([trained] * len(ids))


@dataclass
class ConversationSet:
    """Encoded conversations of one file, and what was left out."""

    examples: list[Example]
    skipped: list[int]  # the lines of conversations with no assistant reply

    @property
    def trained_tokens(self) -> int:
        return sum(sum(e.trained) for e in self.examples)

    def stream(self) -> tuple[np.ndarray, np.ndarray]:
        """All examples packed end to end: ids (N,) int64 and trained (N,) bool."""
        ids = np.array([i for e in self.examples for i in e.ids], dtype=np.int64)
        trained = np.array([t for e in self.examples for t in e.trained], dtype=bool)
        return ids, trained


def encode_conversations(conversations: list[Conversation], chat: ChatTemplate,
                         tokenizer: Tokenizer) -> ConversationSet:
    """Each conversation with an assistant reply encoded; those without one are counted in
    `skipped` (there is nothing to train on)."""
    examples, skipped = [], []
    for conversation in conversations:
        if any(m["role"] == "assistant" for m in conversation.messages):
            examples.append(encode_conversation(conversation, chat, tokenizer))
        else:
            skipped.append(conversation.line)
    return ConversationSet(examples, skipped)


def show_mask(example: Example, tokenizer: Tokenizer) -> str:
    """The example's text with each trained run of tokens in [[ ]]: what the loss sees."""
    pieces, run, trained = [], [], False
    for token, is_trained in zip(example.ids, example.trained, strict=True):
        if is_trained != trained and run:
            pieces.append(_shown(tokenizer.decode(run), trained))
            run = []
        run.append(token)
        trained = is_trained
    if run:
        pieces.append(_shown(tokenizer.decode(run), trained))
    return "".join(pieces)


def _shown(text: str, trained: bool) -> str:
    return f"[[{text}]]" if trained else text


# --- batches -----------------------------------------------------------------------------------

class ConversationSampler:
    """Random windows (x, y) of `block_size` tokens from packed conversations, y shifted by
    one and -1 where the target is not an assistant token. Only windows holding a trained
    target are drawn. Its own torch.Generator, as BatchSampler's, so training resumes on the
    very next batch."""

    def __init__(self, ids: np.ndarray, trained: np.ndarray, block_size: int, batch_size: int,
                 seed: int, device: str | torch.device = "cpu"):
        ids, trained = _padded(ids, trained, block_size + 1)
        targets = np.where(trained, ids, IGNORED)  # (N,)
        self.ids, self.targets = ids, targets
        self.block_size, self.batch_size = block_size, batch_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = np.arange(block_size)  # (T,)
        # Window s reads targets s+1 .. s+T; keep the starts where one of them is trained.
        counts = np.concatenate([[0], np.cumsum(trained)])  # (N + 1,)
        starts = np.arange(len(ids) - block_size)
        self.starts = starts[counts[starts + block_size + 1] - counts[starts + 1] > 0]
        if len(self.starts) == 0:
            raise DataError("no window of the conversations holds an assistant token")

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """x, y: (B, T) int64 on the sampler's device."""
        pick = torch.randint(len(self.starts), (self.batch_size,), generator=self.generator)
        starts = self.starts[pick.numpy()][:, None] + self.offsets  # (B, T)
        x = torch.from_numpy(self.ids[starts])
        y = torch.from_numpy(self.targets[starts + 1])
        return x.to(self.device), y.to(self.device)

    def get_state(self) -> Tensor:
        return self.generator.get_state()

    def set_state(self, state: Tensor) -> None:
        self.generator.set_state(state)


def _padded(ids: np.ndarray, trained: np.ndarray, length: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """A stream of at least `length` tokens: a short one is extended with untrained zeros."""
    missing = length - len(ids)
    if missing <= 0:
        return ids, trained
    return (np.concatenate([ids, np.zeros(missing, dtype=np.int64)]),
            np.concatenate([trained, np.zeros(missing, dtype=bool)]))
