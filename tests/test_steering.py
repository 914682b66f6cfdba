"""Steering while generating (issue 42 item 3): glassgpt.interp.methods.steering and `glassgpt
sample --steer`. The steered tokens of KV-cache decoding equal a recompute of the whole sequence
with the same hook; scale 0 is the unsteered text; a large push along a token's unembedding makes
the model say that token; every bad input is refused by name (one line, exit 2, on the CLI)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_gpt
from glassgpt import generate
from glassgpt.cli import main
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp import run_with_hooks
from glassgpt.interp.methods.steering import load_steering, steering_hook
from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.rundir.checkpoint import Run

RESID = "blocks.1.hook_resid_post"
WIDTH = 32


@pytest.fixture()
def model():
    return tiny_gpt(n_embd=WIDTH, vocab_size=40).eval()


@pytest.fixture()
def prompt():
    return torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])


@pytest.fixture()
def sae_dir(tmp_path):
    torch.manual_seed(1)
    sae = SAE(SAEConfig(WIDTH, 64, metadata={"hook_name": RESID}))
    return sae.save(tmp_path / "sae"), sae


def greedy_recompute(model, ids, hooks, new_tokens):
    """Each next token from a forward pass over the whole sequence so far, hooks attached."""
    for _ in range(new_tokens):
        logits = run_with_hooks(model, ids, hooks)  # (B, T, V)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


# --- the hook while decoding -------------------------------------------------------------------

def test_steered_decoding_equals_a_recompute_with_the_same_hook(model, prompt):
    torch.manual_seed(2)
    hooks = [(RESID, steering_hook(torch.randn(WIDTH), 3.0))]
    cached = generate(model, prompt, hooks=hooks, max_new_tokens=12, temperature=0)
    uncached = generate(model, prompt, hooks=hooks, max_new_tokens=12, temperature=0,
                        use_cache=False)
    assert torch.equal(cached, greedy_recompute(model, prompt, hooks, 12))
    assert torch.equal(cached, uncached)
    plain = generate(model, prompt, max_new_tokens=12, temperature=0)
    assert not torch.equal(cached, plain)  # the steering did change the text


def test_scale_zero_is_the_unsteered_text_exactly(model, prompt):
    hooks = [(RESID, steering_hook(torch.randn(WIDTH), 0.0))]
    steered = generate(model, prompt, hooks=hooks, max_new_tokens=10, temperature=0.9, seed=4)
    assert torch.equal(steered, generate(model, prompt, max_new_tokens=10, temperature=0.9,
                                         seed=4))


def test_a_push_along_a_tokens_unembedding_makes_the_model_say_it(model, prompt):
    plain = generate(model, prompt, max_new_tokens=8, temperature=0)[:, prompt.shape[1]:]
    token = next(t for t in range(40) if not (plain == t).any())
    direction = model.lm_head.weight.detach()[token]  # (C,): the token's unembedding
    hooks = [(RESID, steering_hook(direction, 200.0))]
    steered = generate(model, prompt, hooks=hooks, max_new_tokens=8, temperature=0)
    assert (steered[:, prompt.shape[1]:] == token).all()


def test_the_hook_checks_the_activations_shape():
    hook = steering_hook(torch.ones(4), 1.0)
    x = torch.zeros(2, 3, 4)
    assert torch.equal(hook(x, "p"), torch.ones(2, 3, 4))
    with pytest.raises(InputError, match=r"shape \(4,\) cannot be added at p, whose activation"):
        hook(torch.zeros(2, 3, 5), "p")
    with pytest.raises(InputError, match="finite"):
        steering_hook(torch.ones(4), float("nan"))


# --- where a direction comes from --------------------------------------------------------------

def test_a_dictionary_latent_is_its_decoder_row_at_its_hook(model, sae_dir):
    path, sae = sae_dir
    steer = load_steering(model, f"{path}:5")
    assert steer.hook == RESID and torch.equal(steer.direction, sae.W_dec.detach()[5])
    elsewhere = load_steering(model, f"{path}:63", at="blocks.0.hook_resid_pre")
    assert elsewhere.hook == "blocks.0.hook_resid_pre"


def test_vector_files_safetensors_and_json(model, tmp_path):
    vector = torch.randn(WIDTH)
    save_file({"v": vector}, tmp_path / "v.safetensors")
    (tmp_path / "v.json").write_text(json.dumps(vector.tolist()))
    for name in ("v.safetensors", "v.json"):
        steer = load_steering(model, str(tmp_path / name), at=RESID)
        assert steer.hook == RESID and torch.equal(steer.direction, vector)
    heads = torch.randn(2, WIDTH // 2)  # hook_z: one position is (head, d_head)
    (tmp_path / "z.json").write_text(json.dumps(heads.tolist()))
    assert torch.equal(load_steering(model, str(tmp_path / "z.json"),
                                     at="blocks.0.attn.hook_z").direction, heads)


@pytest.mark.parametrize("spec, at, error, message", [
    ("{d}/nope.json", RESID, CheckpointError, "no steering vector file"),
    ("{d}/nope:3", None, CheckpointError, "no dictionary directory"),
    ("{d}/sae:64", None, InputError, "latent 64 is outside the dictionary's 64 latents"),
    ("{d}/sae:-1", None, InputError, "latent -1 is outside"),
    ("{d}/sae", None, InputError, "is a directory: name one of a dictionary's latents"),
    ("{d}/sae:2", "blocks.1.hook_resid_psot", InputError, "did you mean blocks.1.hook_resid_post"),
    ("{d}/sae:2", "blocks.0.mlp.hook_pre", InputError, r"one position of blocks.0.mlp.hook_pre "
     r"is \(128,\)"),
    ("{d}/v.json", None, InputError, "a vector with no hook point"),
    ("{d}/short.json", RESID, InputError, r"has shape \(3,\), but one position"),
    ("{d}/v.pt", RESID, InputError, "are not read: they may hold pickles"),
    ("{d}/two.safetensors", RESID, InputError, "holds 2 tensors"),
    ("{d}/words.json", RESID, InputError, r'item \[0\] is "a", not a number'),
])
def test_bad_directions_are_refused_by_name(model, sae_dir, tmp_path, spec, at, error,
                                            message):
    (tmp_path / "v.json").write_text(json.dumps([0.0] * WIDTH))
    (tmp_path / "short.json").write_text("[1, 2, 3]")
    (tmp_path / "words.json").write_text('["a", "b"]')
    (tmp_path / "v.pt").write_bytes(b"not read")
    save_file({"a": torch.ones(WIDTH), "b": torch.ones(WIDTH)}, tmp_path / "two.safetensors")
    with pytest.raises(error, match=message):
        load_steering(model, spec.format(d=tmp_path), at)



@pytest.mark.parametrize("text, message", [
    ("[true, 1.0]", r"item \[0\] is true, not a number"),
    ("[[1.0, 2.0], [3.0, false]]", r"item \[1\]\[1\] is false, not a number"),
    ('[1.0, "2"]', r'item \[1\] is "2", not a number'),
    ("[1.0, null]", r"item \[1\] is null, not a number"),
    ('{"v": [1.0]}', "holds an object, not a list of numbers"),
    ("true", "holds true, not a list of numbers"),
    ("[1e39, 1.0]", r"item \[0\] is 1e\+39, beyond float32's range"),
    ("[[1.0, 2.0], [3.0]]", "not a list of numbers of one shape"),
    ("[1.0, [2.0]]", "not a list of numbers of one shape"),
])
def test_a_json_vector_holds_numbers_only(tmp_path, text, message):
    """true was once read as 1 and 1e39 as inf (blamed on NaN): each is named where it is."""
    from glassgpt.interp.methods.steering import _read_vector

    (tmp_path / "v.json").write_text(text)
    with pytest.raises(InputError, match=message):
        _read_vector(str(tmp_path / "v.json"))

# --- glassgpt sample --steer -------------------------------------------------------------------

def sample_args(run, *extra):
    return ["sample", str(run), "--prompt", "To be", "--max-new-tokens", "12",
            "--temperature", "0", "--threads", "1", *extra]


def cli_text(capsys, *args):
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_sample_steer_prints_what_generate_gives_with_the_hook(trained_run, tmp_path, capsys):
    model, tokenizer = Run(trained_run.run).load_model("cpu")
    token = tokenizer.encode("q")[0]
    direction = model.lm_head.weight.detach()[token]  # (C,)
    (tmp_path / "q.json").write_text(json.dumps(direction.tolist()))
    at = "blocks.0.hook_resid_post"
    plain = cli_text(capsys, *sample_args(trained_run.run))
    zero = cli_text(capsys, *sample_args(trained_run.run, "--steer", str(tmp_path / "q.json"),
                                         "--at", at, "--scale", "0"))
    assert zero == plain
    steered = cli_text(capsys, *sample_args(trained_run.run, "--steer",
                                            str(tmp_path / "q.json"), "--at", at,
                                            "--scale", "300"))
    ids = torch.tensor([tokenizer.encode("To be")])
    want = generate(model, ids, hooks=[(at, steering_hook(direction, 300.0))],
                    max_new_tokens=12, temperature=0)
    assert steered == "To be" + tokenizer.decode(want[0, ids.shape[1]:].tolist()) + "\n"
    assert steered.count("q") >= 6 and plain.count("q") < 6


@pytest.mark.parametrize("extra, message", [
    (["--steer", "{d}/v.json", "--at", "blocks.0.hook_resid_post", "--scale", "1",
      "--compile"], "--compile cannot go with --steer"),
    (["--at", "blocks.0.hook_resid_post"], "--at goes with --steer"),
    (["--scale", "2"], "--scale goes with --steer"),
    (["--any-run"], "--any-run goes with --steer"),  # it was ignored without a word
    (["--steer", "{d}/v.json", "--at", "blocks.0.hook_resid_post"], "--steer needs --scale"),
    (["--steer", "{d}/v.json", "--steer", "{d}/v.json", "--steer", "{d}/v.json",
      "--scale", "1", "--scale", "2"], "--scale is given 2 times for 3 --steer"),
    (["--steer", "{d}/missing.json", "--at", "blocks.0.hook_resid_post", "--scale", "1"],
     "no steering vector file"),
    (["--steer", "{d}/v.json", "--at", "blocks.0.hook_resid", "--scale", "1"],
     "no hook point 'blocks.0.hook_resid' in the model; did you mean"),
    (["--steer", "{d}/v.json", "--at", "blocks.0.mlp.hook_post", "--scale", "1"],
     "but one position of blocks.0.mlp.hook_post is"),
    (["--steer", "{d}/v.json", "--scale", "1"], "a vector with no hook point"),
    (["--steer", "{d}/bools.json", "--at", "blocks.0.hook_resid_post", "--scale", "1"],
     "item [0] is true, not a number"),
])
def test_sample_steer_refusals_are_one_line(trained_run, tmp_path, capsys, extra, message):
    (tmp_path / "v.json").write_text(json.dumps([0.5] * 16))  # the trained run is 16 wide
    (tmp_path / "bools.json").write_text(json.dumps([True] * 16))
    capsys.readouterr()
    assert main(sample_args(trained_run.run, *[e.format(d=tmp_path) for e in extra])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_sample_steer_with_a_dictionary_latent_and_a_bad_index(trained_run, tmp_path, capsys):
    torch.manual_seed(3)
    path = SAE(SAEConfig(16, 32, metadata={"hook_name": "blocks.0.hook_resid_post"})).save(
        tmp_path / "sae")
    plain = cli_text(capsys, *sample_args(trained_run.run))
    assert main(sample_args(trained_run.run, "--steer", f"{path}:7", "--scale", "0")) == 0
    said = capsys.readouterr()
    assert said.out == plain
    assert f"steering: 0 x {path}:7 added at blocks.0.hook_resid_post" in said.err
    assert main(sample_args(trained_run.run, "--steer", f"{path}:32", "--scale", "1")) == 2
    assert "latent 32 is outside the dictionary's 32 latents" in capsys.readouterr().err
