"""Write the SAELens fixtures of tests/test_sae.py: one tiny random dictionary per architecture,
saved by SAELens itself, with SAELens's own outputs on a fixed input batch.

Run with SAELens installed (it cannot sit beside transformer-lens 4 in glassgpt's venv):
    python3 -m venv /tmp/saelens_venv
    /tmp/saelens_venv/bin/pip install torch==2.13.0 sae-lens==6.54.12
    /tmp/saelens_venv/bin/python tests/data/saelens/make_fixtures.py tests/data/saelens

Each <out>/<name>/ holds SAELens's cfg.json and sae_weights.safetensors, and expected.safetensors:
x (3, 4, d_in), SAELens's encode(x), decode(encode(x)) and the pre-activations at its
hook_sae_acts_pre (read with its run_with_cache).
"""

import sys
from pathlib import Path

import sae_lens
import torch
from sae_lens import (
    SAE,
    BatchTopKTrainingSAE,
    BatchTopKTrainingSAEConfig,
    JumpReLUSAE,
    JumpReLUSAEConfig,
    JumpReLUTranscoder,
    JumpReLUTranscoderConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
    Transcoder,
    TranscoderConfig,
)
from sae_lens.saes.sae import SAEMetadata
from safetensors.torch import save_file

D_IN, D_SAE, D_OUT = 16, 64, 24
HOOK = "blocks.1.hook_resid_post"
TRANSCODER_IN, TRANSCODER_OUT = "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out"


def metadata(hook_name=HOOK, **extra):
    return SAEMetadata(model_name="glassgpt-fixture", hook_name=hook_name, hook_head_index=None,
                       context_size=4, prepend_bos=False, **extra)


def randomize(sae, seed, threshold=None):
    """Non-trivial biases (and thresholds), and decoder rows of unequal norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sae.state_dict().items():
            if name == "topk_threshold":
                continue
            fresh = torch.randn(tensor.shape, generator=generator) * 0.3
            if name == "W_dec":
                fresh = fresh * (0.5 + torch.rand(tensor.shape[0], 1, generator=generator))
            if name == "threshold":
                fresh = torch.rand(tensor.shape, generator=generator) * threshold
            getattr(sae, name).data.copy_(fresh)
    return sae


def make(name):
    if name == "standard":
        return randomize(StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=D_SAE,
                                                       metadata=metadata())), 1)
    if name == "standard_no_b_dec_input":
        return randomize(StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=D_SAE,
                                                       apply_b_dec_to_input=False,
                                                       metadata=metadata())), 2)
    if name == "topk":
        return randomize(TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8,
                                               metadata=metadata())), 3)
    if name == "topk_rescaled":
        return randomize(TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8,
                                               rescale_acts_by_decoder_norm=True,
                                               metadata=metadata())), 4)
    if name == "jumprelu":
        return randomize(JumpReLUSAE(JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE,
                                                       metadata=metadata())), 5, threshold=0.6)
    if name == "transcoder":
        return randomize(Transcoder(TranscoderConfig(
            d_in=D_IN, d_sae=D_SAE, d_out=D_OUT, apply_b_dec_to_input=False,
            metadata=metadata(TRANSCODER_IN, hook_name_out=TRANSCODER_OUT))), 6)
    if name == "jumprelu_transcoder":
        return randomize(JumpReLUTranscoder(JumpReLUTranscoderConfig(
            d_in=D_IN, d_sae=D_SAE, d_out=D_OUT, apply_b_dec_to_input=False,
            metadata=metadata(TRANSCODER_IN, hook_name_out=TRANSCODER_OUT))),
            7, threshold=0.6)
    raise ValueError(name)


def save_batchtopk(directory):
    """A BatchTopK SAE as SAELens's trainer leaves it: save_inference_model writes a JumpReLU
    SAE whose threshold is the learned batch threshold, the same for every latent."""
    training = BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(
        d_in=D_IN, d_sae=D_SAE, k=4, rescale_acts_by_decoder_norm=True, metadata=metadata()))
    randomize(training, 8)
    training.topk_threshold = torch.tensor(0.35, dtype=torch.double)
    training.save_inference_model(directory)


def write_expected(sae, directory, seed):
    x = torch.randn(3, 4, sae.cfg.d_in, generator=torch.Generator().manual_seed(100 + seed)) * 2
    _, cache = sae.run_with_cache(x)
    with torch.no_grad():
        encoded = sae.encode(x)
        decoded = sae.decode(encoded)
    assert torch.equal(cache["hook_sae_acts_post"], encoded)
    assert torch.equal(cache["hook_sae_recons"], decoded)
    expected = {"x": x, "acts_pre": cache["hook_sae_acts_pre"].clone(), "encode": encoded,
                "decode": decoded}
    save_file(expected, directory / "expected.safetensors")


def main(out):
    torch.manual_seed(0)
    names = ["standard", "standard_no_b_dec_input", "topk", "topk_rescaled", "jumprelu",
             "transcoder", "jumprelu_transcoder"]
    for seed, name in enumerate(names):
        directory = out / name
        make(name).save_model(directory)
        write_expected(SAE.load_from_disk(directory), directory, seed)
    save_batchtopk(out / "batchtopk")
    write_expected(SAE.load_from_disk(out / "batchtopk"), out / "batchtopk", len(names))
    # the sparsity file SAELens's runner writes beside a trained SAE: log10 of each latent's
    # firing frequency (llm_sae_training_runner.save_final_sae)
    frequency = torch.rand(D_SAE, generator=torch.Generator().manual_seed(9))
    save_file({"sparsity": torch.log10(frequency + 1e-10)},
              out / "standard" / "sparsity.safetensors")
    print(f"SAELens {sae_lens.__version__}, torch {torch.__version__}: wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
