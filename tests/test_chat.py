"""Chat templates: an imported instruct model keeps its tokenizer's template, `sample --chat`
renders it exactly as transformers' `apply_chat_template` does, stops at its end-of-turn token,
and renders it in a sandbox (a template is code from whoever published the model)."""

# ruff: noqa: E501  (the published Qwen3 template, below, has long lines)
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glassgpt.cli import main
from glassgpt.errors import TokenizerError
from glassgpt.rundir.checkpoint import Run
from glassgpt.storage.layout import CHAT_TEMPLATE_FILE
from glassgpt.tokenizers import BPETokenizer
from glassgpt.tokenizers.chat import ChatTemplate, chat_messages, render_chat

transformers = pytest.importorskip("transformers")

# Written from the published templates (Qwen/Qwen3-0.6B and HuggingFaceTB/SmolLM2-135M-Instruct,
# tokenizer_config.json's chat_template); Qwen3's tool-call branch is left out.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# Written from Meta-Llama-3-8B-Instruct's and gemma-3's published templates (Gemma's image
# branch left out), and one that uses what other templates do: macros, namespaces, loop
# variables, `~`, map and join, tojson with an indent, string methods.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>"
    "assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}"""
FEATURES_TEMPLATE = """{%- macro turn(role, text) -%}
<|im_start|>{{ role ~ '\n' ~ text.strip() }}<|im_end|>{{ '\n' }}
{%- endmacro -%}
{%- set ns = namespace(count=0, roles=[]) -%}
{%- for message in messages if message.content is string -%}
    {%- set ns.count = ns.count + 1 -%}
    {%- set ns.roles = ns.roles + [message.role] -%}
    {{ turn(message.role, message.content) }}
    {%- if loop.last %}{{ '%d of %d, %s' % (loop.index, loop.length, loop.revindex0) }}{% endif %}
{%- endfor -%}
{{ ns.roles | join(', ') }} {{ messages | map(attribute='role') | unique | list | length }}
{{ messages | tojson(indent=2) }} {{ messages[-1] | tojson }} {{ '{:>6}|{:.3f}'.format('ab', 2 / 3) }}
{{ '-' * 3 }}{{ 2 ** 10 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ [1, 2] + [3] }} {{ 'a,b' .split(',') | reverse | join }}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONVERSATIONS = [
    chat_messages("What is 2 + 2?"),
    chat_messages("Écris un haïku.", "You answer in French."),
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nthey greet\n</think>\n\nHello!"},
     {"role": "user", "content": "Who are you?"}],
]


def chat_tokenizer(text: str) -> BPETokenizer:
    tokenizer = BPETokenizer.train(text, 300)
    tokenizer.tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def transformers_tokenizer(tokenizer: BPETokenizer, template: str):
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer,
                                                   bos_token="<|endoftext|>",
                                                   eos_token="<|im_end|>",
                                                   pad_token="<|endoftext|>")
    wrapped.chat_template = template
    return wrapped


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, SMOLLM2_TEMPLATE, LLAMA3_TEMPLATE,
                                      GEMMA3_TEMPLATE, FEATURES_TEMPLATE],
                         ids=["qwen3", "smollm2", "llama3", "gemma3", "features"])
def test_rendering_is_transformers_own(template: str, small_text: Path) -> None:
    """Bounded (glassgpt.tokenizers.sandbox), a real template still renders exactly so."""
    hf = transformers_tokenizer(chat_tokenizer(small_text.read_text(encoding="utf-8")),
                                template)
    chat = ChatTemplate(template, "<|im_end|>",
                        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                         "pad_token": "<|endoftext|>"})
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.render(messages) == expected
        assert render_chat(template, messages, False, chat.special_tokens) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


@pytest.fixture()
def qwen3_source(tmp_path: Path, small_text: Path) -> Path:
    """A tiny random Qwen3 instruct model: its tokenizer knows <|im_start|> and <|im_end|>,
    its tokenizer_config.json carries the chat template, and <|im_end|> wins soon enough
    that greedy replies end within a few tokens."""
    tokenizer = chat_tokenizer(small_text.read_text(encoding="utf-8"))
    config = transformers.Qwen3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight[end] *= 8  # a likely token, not a certain one
    path = tmp_path / "qwen3-chat"
    model.save_pretrained(path)
    tokenizer.save(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": QWEN3_TEMPLATE, "eos_token": "<|im_end|>",
         "pad_token": {"content": "<|endoftext|>", "special": True}}), encoding="utf-8")
    return path


def test_an_imported_run_chats_through_its_template_and_stops_at_its_end(
        qwen3_source: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(run)]) == 0
    assert "kept its chat template" in capsys.readouterr().err
    assert (run / CHAT_TEMPLATE_FILE).is_file()
    assert Run(run).chat_template().end_of_turn == "<|im_end|>"
    assert main(["sample", str(run), "--chat", "Who are you?", "--system", "Be brief.",
                 "--temperature", "0", "--max-new-tokens", "40", "--device", "cpu"]) == 0
    reply = capsys.readouterr().out
    # transformers, on the same weights and the same rendering, greedy until <|im_end|>.
    hf_tokenizer = transformers_tokenizer(
        BPETokenizer.from_json((qwen3_source / "tokenizer.json").read_text()), QWEN3_TEMPLATE)
    model = transformers.Qwen3ForCausalLM.from_pretrained(qwen3_source).eval()
    ids = hf_tokenizer.apply_chat_template(chat_messages("Who are you?", "Be brief."),
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=40, do_sample=False,
                         eos_token_id=hf_tokenizer.eos_token_id, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] == hf_tokenizer.eos_token_id and len(new) < 40  # it did stop there
    assert reply == hf_tokenizer.decode(new[:-1]) + "\n"
    assert "<|im_end|>" not in reply


def test_an_exported_instruct_model_keeps_its_template_and_where_a_reply_ends(
        qwen3_source: Path, tmp_path: Path, capsys) -> None:
    """Issue 38, item 9: `convert --to-hf` of an imported instruct model writes its chat
    template and its <|im_end|> as eos (tokenizer, config, generation config), so that
    transformers' apply_chat_template and chat pipeline work on the export as on the source."""
    run, out = tmp_path / "run", tmp_path / "exported"
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(run)]) == 0
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0
    assert "with its chat template (a reply ends at <|im_end|>)" in capsys.readouterr().out
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported.chat_template == QWEN3_TEMPLATE
    assert (exported.eos_token, exported.pad_token) == ("<|im_end|>", "<|endoftext|>")
    end = exported.convert_tokens_to_ids("<|im_end|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.eos_token_id == end and model.generation_config.eos_token_id == end
    source = transformers_tokenizer(
        BPETokenizer.from_json((qwen3_source / "tokenizer.json").read_text()), QWEN3_TEMPLATE)
    messages = chat_messages("Who are you?", "Be brief.")
    assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
        == source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The chat pipeline replies as the source model does, greedy until <|im_end|>.
    ids = source.apply_chat_template(messages, add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    original = transformers.Qwen3ForCausalLM.from_pretrained(qwen3_source).eval()
    new = original.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=end,
                            pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert new[-1] == end
    chat = transformers.pipeline("text-generation", model=model, tokenizer=exported)
    reply = chat(messages, max_new_tokens=40, do_sample=False)[0]["generated_text"][-1]
    assert reply == {"role": "assistant", "content": source.decode(new[:-1])}


def test_a_template_that_reaches_for_python_internals_fails_with_one_line(
        qwen3_source: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(run)]) == 0
    hostile = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "<|im_end|>")
    (run / CHAT_TEMPLATE_FILE).write_text(hostile.to_json(), encoding="utf-8")
    capsys.readouterr()
    assert main(["sample", str(run), "--chat", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the chat template tried something the sandbox forbids")
    assert err.count("\n") == 1 and "__class__" in err
    for escape in ["{% set ns = namespace(_x=1) %}", "{{ messages.__class__ }}",
                   "{{ raise_exception.__globals__ }}", "{{ cycler.__init__.__globals__ }}",
                   "{{ messages.append(1) }}"]:
        with pytest.raises(TokenizerError, match="the sandbox forbids"):
            render_chat(escape, chat_messages("hi"))


def test_a_template_that_fails_or_spends_too_much_is_one_line_from_sample(
        qwen3_source: Path, tmp_path: Path, capsys) -> None:
    """Its own errors and its bounds (tests/test_chat_bounds.py) alike: one line, exit 2."""
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(run)]) == 0
    for template, reason in [
            ("{{ 1 // 0 }}", "failed while rendering: ZeroDivisionError"),
            ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "it recursed too deeply"),
            ("{{ 10 ** (10 ** 8) }}", "was stopped: `**` would make an integer of about"),
            ("{{ lipsum(1000000) }}", "was stopped: lipsum would make more than")]:
        (run / CHAT_TEMPLATE_FILE).write_text(ChatTemplate(template, "<|im_end|>").to_json(),
                                              encoding="utf-8")
        capsys.readouterr()
        assert main(["sample", str(run), "--chat", "hi", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the chat template ") and err.count("\n") == 1
        assert reason in err


def test_a_run_without_a_template_says_so_in_one_line(trained_run, capsys) -> None:
    assert main(["sample", str(trained_run.run), "--chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "has no chat template" in err and "--prompt" in err
    assert main(["sample", str(trained_run.run), "--system", "Be brief."]) == 2
    assert "--system goes with --chat" in capsys.readouterr().err


def test_a_template_is_kept_only_when_a_reply_can_stop(qwen3_source: Path, tmp_path: Path,
                                                       capsys) -> None:
    config_path = qwen3_source / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps({**config, "eos_token": "no such token"}),
                           encoding="utf-8")
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(tmp_path / "a")]) == 0
    assert "its chat template is not kept" in capsys.readouterr().err
    assert not (tmp_path / "a" / CHAT_TEMPLATE_FILE).exists()
    config_path.write_text(json.dumps({**config, "chat_template": 5}), encoding="utf-8")
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "chat_template must be a string" in err
    assert not (tmp_path / "b").exists()
    # transformers 5 writes the template to chat_template.jinja; that file comes first.
    config_path.write_text(json.dumps(config), encoding="utf-8")
    (qwen3_source / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE, encoding="utf-8")
    assert main(["convert", "--from-hf", str(qwen3_source), "--out", str(tmp_path / "c")]) == 0
    assert Run(tmp_path / "c").chat_template().template == SMOLLM2_TEMPLATE


def with_bos(tokenizer: BPETokenizer) -> BPETokenizer:
    """The tokenizer with a post-processor that starts every text with <bos>, as Llama 3's and
    Gemma's tokenizer.json do (and one that would end it with <eos>, which a prompt leaves off)."""
    from tokenizers import processors
    tokenizer.tokenizer.add_special_tokens(["<bos>", "<eos>"])
    bos, eos = (tokenizer.tokenizer.token_to_id(t) for t in ("<bos>", "<eos>"))
    tokenizer.tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)])
    return tokenizer


def test_a_prompt_starts_as_transformers_tokenizer_starts_it_and_a_chat_as_its_template(
        small_text: Path) -> None:
    from glassgpt.decoding.generate import encode_prompt
    tokenizer = with_bos(chat_tokenizer(small_text.read_text(encoding="utf-8")))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer)
    bos = tokenizer.tokenizer.token_to_id("<bos>")
    ids, _ = encode_prompt(tokenizer, "To be, or not", 64)
    expected = hf("To be, or not").input_ids
    assert ids[0].tolist() == expected[:-1] and ids[0, 0] == bos  # <bos> first, no <eos>
    rendered, _ = encode_prompt(tokenizer, "<bos>Hi", 64, special=False)
    assert rendered[0].tolist().count(bos) == 1  # a chat template's own <bos>, not a second
    plain = chat_tokenizer(small_text.read_text(encoding="utf-8"))  # glassgpt's own BPE
    assert encode_prompt(plain, "To be", 64)[0][0].tolist() == plain.encode("To be")
