"""Load dictionaries saved by glassgpt with SAELens's own loader and compare its encode/decode
with glassgpt's (expected.safetensors, written by write_from_glassgpt.py).

    /tmp/saelens_venv/bin/python tests/data/saelens/check_in_saelens.py /tmp/glassgpt_saes
"""

import sys
from pathlib import Path

import sae_lens
import torch
from sae_lens import SAE
from sae_lens.loading.pretrained_sae_loaders import get_sae_lens_config_from_disk
from safetensors.torch import load_file


def main(root: Path) -> None:
    print(f"SAELens {sae_lens.__version__}, torch {torch.__version__}")
    worst = 0.0
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        sae = SAE.load_from_disk(directory)
        expected = load_file(directory / "expected.safetensors")
        with torch.no_grad():
            encoded = sae.encode(expected["x"])
            decoded = sae.decode(expected["encode"])
        encode_error = (encoded - expected["encode"]).abs().max().item()
        decode_error = (decoded - expected["decode"]).abs().max().item()
        worst = max(worst, encode_error, decode_error)
        metadata = get_sae_lens_config_from_disk(directory)["metadata"]
        sparsity = (directory / "sparsity.safetensors").exists()
        print(f"{directory.name:24} {type(sae).__name__:20} hook {sae.cfg.metadata.hook_name}"
              f"{' -> ' + metadata['hook_name_out'] if 'hook_name_out' in metadata else ''}: "
              f"max |encode diff| {encode_error:.3g}, max |decode diff| {decode_error:.3g}, "
              f"bit-equal {torch.equal(encoded, expected['encode'])} / "
              f"{torch.equal(decoded, expected['decode'])}"
              f"{', sparsity.safetensors present' if sparsity else ''}")
    print(f"worst difference: {worst:.3g}")
    if worst > 1e-6:
        raise SystemExit("SAELens disagrees with glassgpt beyond 1e-6")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
