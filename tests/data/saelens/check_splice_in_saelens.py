"""SAELens's HookedSAETransformer (over TransformerLens 3.9) runs write_splice_case.py's model
with the same dictionaries spliced in; its logits are compared with glassgpt's.

    /tmp/saelens_venv/bin/python tests/data/saelens/check_splice_in_saelens.py /tmp/glassgpt_splice
"""

import json
import sys
from pathlib import Path

import sae_lens
from sae_lens import SAE, HookedSAETransformer
from safetensors.torch import load_file
from transformer_lens import HookedTransformerConfig


def main(root: Path) -> None:
    cfg = json.loads((root / "model" / "config.json").read_text())
    model = HookedSAETransformer(HookedTransformerConfig(**cfg))
    state = load_file(root / "model" / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "hook" not in k], (missing, unexpected)
    model.eval()
    want = load_file(root / "logits.safetensors")
    ids = want["ids"]
    print(f"SAELens {sae_lens.__version__}; clean logits max |diff| "
          f"{(model(ids) - want['clean']).abs().max().item():.3g}")
    names = ["resid_topk", "mlp_out_jumprelu", "transcoder"]
    saes = {name: SAE.load_from_disk(root / name) for name in names}
    worst = 0.0
    for name in names:
        for error in (False, True):
            got = model.run_with_saes(ids, saes=[saes[name]], use_error_term=error)
            diff = (got - want[f"{name}_{error}"]).abs().max().item()
            moved = (got - want["clean"]).abs().max().item()
            worst = max(worst, diff)
            print(f"{name:18} use_error_term={error!s:5}: max |diff| {diff:.3g} "
                  f"(the splice moved the logits by up to {moved:.3g})")
    got = model.run_with_saes(ids, saes=list(saes.values()))
    diff = (got - want["all_False"]).abs().max().item()
    worst = max(worst, diff)
    print(f"all three at once: max |diff| {diff:.3g}\nworst {worst:.3g}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
