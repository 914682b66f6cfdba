"""Write dictionaries with glassgpt, for check_in_saelens.py to load with SAELens.

    .venv/bin/python tests/data/saelens/write_from_glassgpt.py /tmp/glassgpt_saes

One fresh random dictionary per architecture, built and saved by glassgpt (SAEConfig, SAE.save),
with glassgpt's encode/decode of a fixed batch in expected.safetensors beside it.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from glassgpt.interp.sae import SAE, SAEConfig

HOOK, MLP_IN, MLP_OUT = "blocks.1.hook_resid_post", "blocks.0.ln2.hook_normalized", \
    "blocks.0.hook_mlp_out"
CONFIGS = {
    "standard": SAEConfig(32, 128, metadata={"hook_name": HOOK}),
    "standard_no_b_dec_input": SAEConfig(32, 128, apply_b_dec_to_input=False,
                                         metadata={"hook_name": HOOK}),
    "topk": SAEConfig(32, 128, "topk", k=6, metadata={"hook_name": HOOK}),
    "topk_rescaled": SAEConfig(32, 128, "topk", k=6, rescale_acts_by_decoder_norm=True,
                               metadata={"hook_name": HOOK}),
    "jumprelu": SAEConfig(32, 128, "jumprelu", metadata={"hook_name": HOOK}),
    "batchtopk": SAEConfig.batchtopk(32, 128, k=6, hook_name=HOOK),
    "transcoder": SAEConfig(32, 128, "transcoder", d_out=40, apply_b_dec_to_input=False,
                            metadata={"hook_name": MLP_IN, "hook_name_out": MLP_OUT}),
    "jumprelu_transcoder": SAEConfig(32, 128, "jumprelu_transcoder", d_out=40,
                                     apply_b_dec_to_input=False,
                                     metadata={"hook_name": MLP_IN, "hook_name_out": MLP_OUT}),
}


def main(out: Path) -> None:
    for seed, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        sae = SAE(config)
        with torch.no_grad():
            for tensor in sae.parameters():
                tensor.copy_(torch.randn_like(tensor) * 0.3)
            if sae.threshold is not None:
                sae.threshold.uniform_(0.0, 0.6)
            if name == "batchtopk":  # one threshold for every latent, as training leaves it
                sae.threshold.fill_(0.4)
        if name == "standard":
            sae.log_sparsity = torch.log10(torch.rand(config.d_sae) + 1e-10)
        sae.save(out / name)
        x = torch.randn(4, 5, config.d_in) * 2
        with torch.no_grad():
            encoded = sae.encode(x)
            save_file({"x": x, "encode": encoded, "decode": sae.decode(encoded)},
                      out / name / "expected.safetensors")
    print(f"wrote {len(CONFIGS)} dictionaries in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
