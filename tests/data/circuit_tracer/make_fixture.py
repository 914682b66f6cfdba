"""The fixture of tests/test_graph_reference.py, built with glassgpt's venv (see
circuit_tracer_graph.py for the whole recipe):  .venv/bin/python make_fixture.py BUILD

Writes BUILD/ (this folder keeps its run/ and tc/):
  run/                 glassgpt run dir (save_model): config.json, model weights, tokenizer
  lens/                TransformerLens checkpoint (write_lens_checkpoint): config.json,
                       model.safetensors
  tc/layer_L/          glassgpt SAE dirs (architecture "transcoder", SAELens format)
  ct_tc/layer_L.safetensors  the same transcoders in circuit-tracer's layout
                       (W_enc (d_sae, d_model), W_dec (d_sae, d_model), b_enc, b_dec), reading
                       TL's blocks.L.ln2.hook_normalized (pre-gain x_hat in TL 3.2.1)
  ct_tc_postgain/layer_L.safetensors  the gain/bias-folded variant (W_enc / w,
                       b_enc - (b/w) @ W_enc)
                       for a hook AFTER the gain and bias (a cross-check)
  recipe/              what docs/interpretability.md's circuit-tracer recipe reads, under its
                       names: repeats-lens/ (`--to-lens --circuit-tracer`), repeats-ct/
                       (`glassgpt sae convert tc/`), runs/repeats/tokenizer.json
  clt_graph/ct_clt/    a random JumpReLU cross-layer transcoder of the model (64 features a
                       layer, reading ln2.hook_normalized, writing hook_mlp_out at its layer and
                       every later one) in circuit-tracer's layout (glassgpt's save_clt)
  softcap/             the same model with a final logit soft-cap (logit_softcap = SOFTCAP, as
                       Gemma 2's final_logit_softcapping): run/, lens/ (whose config carries
                       it as output_logits_soft_cap), ct-lens/ (`--circuit-tracer`, for
                       the CLT's graph), ct_tc/ (the same transcoders: the cap
                       changes nothing before the logits), prompt.json, and glass_logits.
                       safetensors (its capped logits), for tests/test_graph_softcap.py
  prompt.json          token ids of the prompt
  glass_acts.safetensors  glassgpt's feature activations (L, T, d_sae), x_hat, mlp_out and logits
"""
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from glassgpt.config import GPTConfig
from glassgpt.formats.transformer_lens_files import write_lens_checkpoint
from glassgpt.interp import run_with_cache
from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.interp.sae.circuit_tracer import convert_to_circuit_tracer
from glassgpt.interp.sae.circuit_tracer_clt import save_clt
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import save_model
from glassgpt.tokenizers.char import CharTokenizer

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("build")
SEED = 1234
N_LAYER, N_HEAD, N_EMBD, BLOCK, VOCAB = 2, 2, 32, 32, 64
D_SAE = 2 * N_EMBD
# BOS-like id 0 first (circuit-tracer would otherwise prepend a special token), 16 tokens
PROMPT = [0, 17, 5, 42, 33, 8, 61, 23, 17, 9, 50, 12]


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    torch.manual_seed(SEED)
    cfg = GPTConfig(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD, block_size=BLOCK,
                    vocab_size=VOCAB)  # GPT-2 defaults: LayerNorm, learned pos, gelu_tanh, tied
    model = GPT(cfg).float().eval()
    # re-draw every parameter so that nothing is degenerate (non-trivial LN gains and biases,
    # attention that is far from uniform, peaked logits)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("ln" in name):
                if name.endswith("weight"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "emb" in name:
                p.copy_(1.0 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    tok = CharTokenizer([chr(48 + i) for i in range(VOCAB)])
    save_model(OUT / "run", model, tok)
    write_lens_checkpoint(model, OUT / "lens")

    ids = torch.tensor([PROMPT])
    logits, cache = run_with_cache(model, ids)

    tensors = {"logits": logits[0].contiguous()}
    ct_tc, ct_tc_post = {}, {}
    for L in range(N_LAYER):
        sc = SAEConfig(d_in=N_EMBD, d_sae=D_SAE, architecture="transcoder", d_out=N_EMBD,
                       apply_b_dec_to_input=False,
                       metadata={"hook_name": f"blocks.{L}.ln2.hook_normalized",
                                 "hook_name_out": f"blocks.{L}.hook_mlp_out"})
        sae = SAE(sc)
        with torch.no_grad():
            sae.W_enc.copy_(torch.randn(N_EMBD, D_SAE, generator=g) / N_EMBD ** 0.5)
            sae.W_dec.copy_(torch.randn(D_SAE, N_EMBD, generator=g) * 0.3 / D_SAE ** 0.5)
            sae.b_dec.copy_(0.05 * torch.randn(N_EMBD, generator=g))
            # shift so that ~20% of latents fire (x_hat has unit RMS, so pre ~ N(b, ~1))
            sae.b_enc.copy_(-0.85 + 0.2 * torch.randn(D_SAE, generator=g))
        sae.save(OUT / "tc" / f"layer_{L}")
        x_hat = cache[f"blocks.{L}.ln2.hook_normalized"][0]  # (T, C), before gain and bias
        acts = sae.encode(x_hat)
        frac = (acts[1:] > 0).float().mean().item()
        print(f"layer {L}: active fraction (positions 1..) = {frac:.3f}")
        tensors[f"acts.{L}"] = acts.detach().contiguous()
        tensors[f"x_hat.{L}"] = x_hat.contiguous()
        tensors[f"mlp_out.{L}"] = cache[f"blocks.{L}.hook_mlp_out"][0].contiguous()
        W_enc = sae.W_enc.detach().T.contiguous()  # (d_sae, d_model): circuit-tracer's layout
        common = {"W_dec": sae.W_dec.detach().contiguous(), "b_dec": sae.b_dec.detach().clone()}
        ct_tc[L] = {"W_enc": W_enc, "b_enc": sae.b_enc.detach().clone(), **common}
        ln = model.blocks[L].ln2
        w, b = ln.weight.detach(), ln.bias.detach()
        ct_tc_post[L] = {"W_enc": (W_enc / w[None, :]).contiguous(),
                         "b_enc": sae.b_enc.detach() - (b / w) @ sae.W_enc.detach(), **common}
    for name, d in (("ct_tc", ct_tc), ("ct_tc_postgain", ct_tc_post)):
        (OUT / name).mkdir()
        for L, t in d.items():
            save_file({k: v.contiguous() for k, v in t.items()},
                      OUT / name / f"layer_{L}.safetensors")
    save_file(tensors, OUT / "glass_acts.safetensors")
    probs = logits[0, -1].softmax(-1)
    print("last-position top probs:", probs.topk(5).values.tolist())
    (OUT / "prompt.json").write_text(json.dumps({"prompt_ids": PROMPT, "seed": SEED,
                                                 "d_sae": D_SAE}) + "\n")
    write_clt(g)
    write_softcap(model, tok, ids)
    recipe = OUT / "recipe"
    write_lens_checkpoint(model, recipe / "repeats-lens", circuit_tracer=True)
    convert_to_circuit_tracer([OUT / "tc"], recipe / "repeats-ct")
    (recipe / "runs" / "repeats").mkdir(parents=True)
    shutil.copy(OUT / "run" / "tokenizer.json", recipe / "runs" / "repeats")
    print("wrote", OUT)


# the soft-cap of the capped copy: at 10 the last position's 9 most probable tokens are needed
# to reach circuit-tracer's 0.95 (3 without the cap), so the cap changes which logits are nodes
SOFTCAP = 10.0


def write_softcap(model: GPT, tok: CharTokenizer, ids: torch.Tensor) -> None:
    """The model with a final logit soft-cap, its TransformerLens checkpoint and its logits."""
    capped = GPT(dataclasses.replace(model.config, logit_softcap=SOFTCAP)).float().eval()
    capped.load_state_dict(model.state_dict())
    folder = OUT / "softcap"
    save_model(folder / "run", capped, tok)
    write_lens_checkpoint(capped, folder / "lens")
    write_lens_checkpoint(capped, folder / "ct-lens", circuit_tracer=True)  # for the CLT
    lens = json.loads((folder / "lens" / "config.json").read_text())
    assert lens["output_logits_soft_cap"] == SOFTCAP, lens["output_logits_soft_cap"]
    shutil.copytree(OUT / "ct_tc", folder / "ct_tc")
    shutil.copy(OUT / "prompt.json", folder / "prompt.json")
    with torch.no_grad():
        logits, _ = capped(ids)
    assert logits.abs().max() < SOFTCAP
    save_file({"logits": logits[0].contiguous()}, folder / "glass_logits.safetensors")


def write_clt(g: torch.Generator) -> None:
    """A JumpReLU CLT whose features fire on ~20% of positions (x_hat has unit RMS, so a
    pre-activation is ~N(b_enc, 1); thresholds near 0.5) and whose decoders write into every
    later layer about as strongly as into their own."""
    clt = CrossLayerTranscoder(N_LAYER, N_EMBD, D_SAE, activation="jumprelu")
    with torch.no_grad():
        clt.W_enc.copy_(torch.randn(N_LAYER, N_EMBD, D_SAE, generator=g) / N_EMBD ** 0.5)
        clt.b_enc.copy_(-0.35 + 0.2 * torch.randn(N_LAYER, D_SAE, generator=g))
        clt.threshold.copy_(0.5 + 0.1 * torch.rand(N_LAYER, D_SAE, generator=g))
        for layer in range(N_LAYER):
            clt.W_dec[layer].copy_(torch.randn(D_SAE, N_LAYER - layer, N_EMBD, generator=g)
                                   * 0.3 / D_SAE ** 0.5)
        clt.b_dec.copy_(0.05 * torch.randn(N_LAYER, N_EMBD, generator=g))
    save_clt(clt, OUT / "clt_graph" / "ct_clt", extra={"scan": "glassgpt-fixture/clt"})


if __name__ == "__main__":
    main()
