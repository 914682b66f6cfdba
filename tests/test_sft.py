"""Conversations for supervised fine-tuning (glassgpt.data.sft): read and checked line by line,
rendered through a chat template, and masked so that exactly the assistant's tokens train; the
mask equals transformers' `return_assistant_tokens_mask` on templates that mark replies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glassgpt.data.sft import (
    Conversation,
    ConversationSampler,
    assistant_spans,
    encode_conversation,
    encode_conversations,
    read_conversations,
    show_mask,
    simple_template,
)
from glassgpt.errors import InputError, TokenizerError
from glassgpt.tokenizers import CharTokenizer
from glassgpt.tokenizers.chat import ChatTemplate
from test_chat import (
    LLAMA3_TEMPLATE,
    QWEN3_TEMPLATE,
    SMOLLM2_TEMPLATE,
    chat_tokenizer,
    transformers_tokenizer,
)

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "A small model."}]
# The published templates with their replies marked as transformers' training templates mark
# them ({% generation %}), so that transformers computes the reference mask.
SMOLLM2_MARKED = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + "
    "'<|im_end|>' + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_MARKED = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
LLAMA_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def trained_text(example, tokenizer) -> list[str]:
    """The decoded runs of trained tokens."""
    runs, current = [], []
    for token, trained in zip(example.ids, example.trained, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


@pytest.fixture(scope="module")
def tokenizer():
    text = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(200))
    bpe = chat_tokenizer(text + " ".join(m["content"] for m in MESSAGES))
    bpe.tokenizer.add_special_tokens(LLAMA_SPECIALS)
    return bpe


@pytest.mark.parametrize(("marked", "end"), [(SMOLLM2_MARKED, "<|im_end|>"),
                                            (LLAMA3_MARKED, "<|eot_id|>")],
                         ids=["smollm2", "llama3"])
def test_the_mask_is_transformers_assistant_mask(marked: str, end: str, tokenizer) -> None:
    """Same ids and same trained positions as transformers' apply_chat_template(...,
    return_assistant_tokens_mask=True): the reply and its end-of-turn token, nothing else."""
    hf = transformers_tokenizer(tokenizer, marked)
    reference = hf.apply_chat_template(MESSAGES, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    ours = encode_conversation(Conversation(1, MESSAGES), ChatTemplate(marked, end), tokenizer)
    assert ours.ids == list(reference["input_ids"])
    assert [int(t) for t in ours.trained] == list(reference["assistant_masks"])
    assert sum(ours.trained) > 0
    assert trained_text(ours, tokenizer) == [f"Hello!{end}", f"A small model.{end}"]


@pytest.mark.parametrize(("template", "end", "replies"), [
    (SMOLLM2_TEMPLATE, "<|im_end|>", ["Hello!<|im_end|>", "A small model.<|im_end|>"]),
    (LLAMA3_TEMPLATE, "<|eot_id|>", ["Hello!<|eot_id|>", "A small model.<|eot_id|>"]),
    # Qwen3 renders its last reply with an (empty) think block, earlier ones without: the
    # model writes that block when it replies, so it trains on it there.
    (QWEN3_TEMPLATE, "<|im_end|>", ["Hello!<|im_end|>",
                                    "<think>\n\n</think>\n\nA small model.<|im_end|>"]),
], ids=["smollm2", "llama3", "qwen3"])
def test_published_templates_train_exactly_the_replies(template: str, end: str,
                                                       replies: list[str], tokenizer) -> None:
    chat = ChatTemplate(template, end, {"bos_token": "<|endoftext|>", "eos_token": end})
    example = encode_conversation(Conversation(1, MESSAGES), chat, tokenizer)
    assert trained_text(example, tokenizer) == replies
    # The whole rendering is transformers' own, and the ids are the prompt's where it chats.
    hf = transformers_tokenizer(tokenizer, template)
    full = hf.apply_chat_template(MESSAGES, tokenize=False)
    assert tokenizer.decode(example.ids) == full
    prompt = chat.render(MESSAGES[:4], add_generation_prompt=True)
    assert example.ids[:len(tokenizer.encode(prompt))] == tokenizer.encode(prompt)


def test_the_simple_template_for_a_run_without_one() -> None:
    chat = simple_template()
    text, spans = assistant_spans(chat, MESSAGES)
    assert text == ("<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\nHello!<|end|>\n"
                    "<|user|>\nWho are you?\n<|assistant|>\nA small model.<|end|>\n")
    assert [text[a:b] for a, b in spans] == ["Hello!<|end|>", "A small model.<|end|>"]
    chars = CharTokenizer.from_text(text)
    example = encode_conversation(Conversation(3, MESSAGES), chat, chars)
    assert example.ids == chars.encode(text)
    trained = "".join(c for c, t in zip(text, example.trained, strict=True) if t)
    assert trained == "Hello!<|end|>A small model.<|end|>"
    assert show_mask(example, chars).endswith(
        "<|assistant|>\n[[A small model.<|end|>]]\n")


def test_a_template_with_no_reply_to_find_is_refused_in_one_line() -> None:
    chat = ChatTemplate("{% for m in messages %}{{ m['content'] | reverse }}{% endfor %}"
                        "{% if add_generation_prompt %}!{% endif %}", None)
    with pytest.raises(TokenizerError, match="cannot find the assistant's replies") as caught:
        encode_conversation(Conversation(7, MESSAGES), chat, CharTokenizer.from_text("abc"))
    assert "line 7" in str(caught.value) and "\n" not in str(caught.value)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"messages": MESSAGES[1:3]})


@pytest.mark.parametrize(("line", "reason"), [
    ("{not json", "not valid JSON"),
    ('{"messages": [], "x": 1}', "only a 'messages' list"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "user"}]}', "exactly the keys role and content"),
    ('{"messages": [{"role": "user", "content": "a", "name": "b"}]}', "exactly the keys"),
    ('{"messages": [{"role": "tool", "content": "a"}]}', "has role 'tool'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string"),
    ('[1, 2]', "only a 'messages' list"),
])
def test_bad_lines_are_named_by_number(line: str, reason: str, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "chats.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(InputError, match=reason) as caught:
        read_conversations(path)
    assert f"{path}:3" in str(caught.value)


def test_conversations_without_a_reply_are_skipped_and_counted(tmp_path: Path) -> None:
    no_reply = json.dumps({"messages": [{"role": "user", "content": "Hi there"}]})
    path = write_lines(tmp_path / "chats.jsonl", [GOOD, no_reply, GOOD, no_reply])
    conversations = read_conversations(path)
    chars = CharTokenizer.from_text(simple_template().render(MESSAGES))
    encoded = encode_conversations(conversations, simple_template(), chars)
    assert len(encoded.examples) == 2 and encoded.skipped == [2, 4]
    assert encoded.trained_tokens == 2 * len("Hello!<|end|>")
    with pytest.raises(InputError, match="holds no conversation"):
        read_conversations(write_lines(tmp_path / "empty.jsonl", ["", "  "]))


def test_batches_target_only_trained_tokens_and_resume_on_the_same_batch() -> None:
    ids = np.arange(40, dtype=np.int64)  # each id its own position: a window shows its start
    trained = np.zeros(40, dtype=bool)
    trained[[12, 13, 30]] = True
    sampler = ConversationSampler(ids, trained, block_size=8, batch_size=16, seed=0)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (16, 8)
    kept = y != -1
    assert kept.any(dim=1).all()  # every window holds a trained target
    # Each kept target is the id after its input, at a trained position.
    for row, start in enumerate(x[:, 0].tolist()):
        assert torch.equal(x[row], torch.arange(start, start + 8))
        positions = torch.arange(start + 1, start + 9)
        expected = torch.where(torch.from_numpy(trained)[positions],
                               torch.from_numpy(ids)[positions], -1)
        assert torch.equal(y[row], expected)
    state = sampler.get_state()
    after = sampler.next_batch()
    sampler.set_state(state)
    assert all(torch.equal(a, b) for a, b in zip(sampler.next_batch(), after, strict=True))
    short = ConversationSampler(ids[:5], trained[:5] | True, 8, 2, 0)  # padded, untrained
    assert (short.next_batch()[1][:, 4:] == -1).all()
