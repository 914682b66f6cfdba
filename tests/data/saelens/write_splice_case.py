"""Write a tiny glassgpt model in TransformerLens's checkpoint format, three dictionaries for it,
and glassgpt's logits with them spliced in, for check_splice_in_saelens.py.

    .venv/bin/python tests/data/saelens/write_splice_case.py /tmp/glassgpt_splice
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from glassgpt.config import GPTConfig
from glassgpt.formats.transformer_lens_files import write_lens_checkpoint
from glassgpt.interp.sae import SAE, SAEConfig, run_with_saes
from glassgpt.model import GPT


def random_sae(config: SAEConfig, seed: int) -> SAE:
    sae = SAE(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        if sae.threshold is not None:
            sae.threshold.abs_()
    return sae


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=4, n_embd=32,
                          dropout=0.0, bias=True)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    write_lens_checkpoint(model, out / "model")
    saes = {"resid_topk": random_sae(SAEConfig(32, 64, "topk", k=5, metadata={
                "hook_name": "blocks.1.hook_resid_post"}), 1),
            "mlp_out_jumprelu": random_sae(SAEConfig(32, 64, "jumprelu", metadata={
                "hook_name": "blocks.1.hook_mlp_out"}), 2),
            "transcoder": random_sae(SAEConfig(32, 48, "transcoder", d_out=32,
                                               apply_b_dec_to_input=False, metadata={
                "hook_name": "blocks.0.ln2.hook_normalized",
                "hook_name_out": "blocks.0.hook_mlp_out"}), 3)}
    ids = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(4))
    logits = {"ids": ids, "clean": model(ids)[0]}
    with torch.no_grad():
        for name, sae in saes.items():
            sae.save(out / name)
            for error in (False, True):
                logits[f"{name}_{error}"] = run_with_saes(model, ids, [sae], use_error_term=error)
        logits["all_False"] = run_with_saes(model, ids, list(saes.values()))
    save_file({k: v.contiguous() for k, v in logits.items()}, out / "logits.safetensors")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
