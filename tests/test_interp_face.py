"""glassgpt.interp's face and its one hook-name grammar (issue 52).

The face imports each public name from its room on first use, so that TransformerLens's line
`from glassgpt.interp import ActivationCache, FactoredMatrix, HookPoint, HookedGPT, utils` keeps
working while the torch-free parts (a dictionary's training settings, the grammar) import
without torch; one `parse_hook_name` reads every hook name, and `stop_at_layer` counts on it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import glassgpt.interp as interp
from glassgpt.hooknames import HookName, parse_hook_name
from glassgpt.interp.core.names import stop_at_layer

TORCH_PROBE = """
import sys
try:
{code}
except SystemExit:  # argparse's --help
    pass
print("TORCH" if "torch" in sys.modules else "NO TORCH")
"""


def imports_torch(code: str) -> bool:
    """Whether a fresh process running `code` imported torch."""
    probe = TORCH_PROBE.format(code="\n".join(f"    {line}" for line in code.splitlines()))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1] == "TORCH"


@pytest.mark.parametrize("code", [
    "import glassgpt.interp",
    "from glassgpt.interp.sae.training.settings import DictionarySettings\n"
    "DictionarySettings(hook='blocks.0.ln2.hook_normalized', d_sae=8, transcoder=True)",
    "from glassgpt.interp.sae.training import ARCHITECTURES, DictionarySettings",
    "from glassgpt.interp.core.names import stop_at_layer",
    "from glassgpt.cli import main\nmain(['sae', 'train', '--help'])",
], ids=["interp", "settings", "training face", "names", "sae train --help"])
def test_the_torch_free_parts_of_interp_import_without_torch(code):
    assert not imports_torch(code)


def test_a_public_name_asked_for_imports_its_room():
    assert imports_torch("from glassgpt.interp import run_with_cache")


def test_every_public_name_of_interp_resolves_to_its_home():
    assert interp.__all__ == sorted(set(interp._HOMES) | set(interp._MODULES))
    for name in interp.__all__:
        value = getattr(interp, name)
        home = getattr(value, "__module__", None) or value.__name__
        assert home.startswith("glassgpt."), name
    assert set(interp.__all__) <= set(dir(interp))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        interp.nope  # noqa: B018


def test_transformer_lens_line_keeps_working():
    from glassgpt.interp import (
        ActivationCache,
        FactoredMatrix,
        HookedGPT,
        HookPoint,
        patching,
        utils,
    )

    assert utils.get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert callable(patching.get_act_patch_resid_pre)
    assert {ActivationCache.__name__, FactoredMatrix.__name__, HookedGPT.__name__,
            HookPoint.__name__} == {"ActivationCache", "FactoredMatrix", "HookedGPT", "HookPoint"}


@pytest.mark.parametrize("name, read", [
    ("blocks.3.attn.hook_z", HookName(3, "attn", "hook_z")),
    ("blocks.3.hook_resid_pre", HookName(3, "", "hook_resid_pre")),
    ("blocks.0.ln2.hook_normalized", HookName(0, "ln2", "hook_normalized")),
    ("blocks.12.mlp.hook_post", HookName(12, "mlp", "hook_post")),
    ("blocks.1.hook_resid_post.hook_sae_acts_post",
     HookName(1, "hook_resid_post", "hook_sae_acts_post")),
    ("hook_embed", HookName(None, "", "hook_embed")),
    ("ln_final.hook_scale", HookName(None, "ln_final", "hook_scale")),
    ("blocks.x.attn.hook_z", HookName(None, "blocks.x.attn", "hook_z")),
    ("blocks.\u00b2.attn.hook_z", HookName(None, "blocks.\u00b2.attn", "hook_z")),
    ("blocks.3", HookName(None, "blocks", "3")),
])
def test_one_grammar_reads_every_hook_name(name, read):
    assert parse_hook_name(name) == read


@pytest.mark.parametrize("names, n_layer, stop", [
    (["hook_embed", "hook_pos_embed"], 4, 0),
    (["blocks.0.hook_resid_pre"], 4, 1),
    (["blocks.2.attn.hook_z", "hook_embed", "blocks.0.ln2.hook_normalized"], 4, 3),
    (["blocks.9.hook_resid_post"], 4, 4),
    (["blocks.1.hook_resid_post", "ln_final.hook_scale"], 4, None),
    (["hook_nothing"], 4, None),
])
def test_stop_at_layer_counts_the_blocks_a_run_needs(names, n_layer, stop):
    assert stop_at_layer(names, n_layer) == stop
