"""docs/notebooks/glassgpt-tour.ipynb runs top to bottom (nbclient, the venv's Python kernel,
offline), and what its cells print still holds: the notebook cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "notebooks" / "glassgpt-tour.ipynb"
CELL_TIMEOUT_S = 60
# What the tour claims, as its cells print it.
CLAIMS = ["same as the module: True True", "parallel == per-head loop (<= 1e-12): True True",
          "manual == nn.LayerNorm: True", "per position, earlier outputs unchanged: True",
          "over (T, C), earlier outputs unchanged:  False", "by hand == block(x): True",
          "parameters: 3280 = 12C^2 + 13C = 3280",
          "GPT-2 small: 124,439,808 counted, 124,439,808 by the formula",
          "sum of the heads' contributions == the attention's output: True",
          "attribution adds up to the logit: True", "patched with its own clean cache: 1.0",
          "resid_pre at the changed position, layer 0: 1.0",
          # section 10: ARENA's cells on a HookedGPT
          "ARENA's scores == head_scores(definition='arena'): True",
          "utils.get_act_name('v', 1): blocks.1.attn.hook_v"]


def printed(notebook) -> str:
    return "".join(output.get("text", "") for cell in notebook.cells
                   if cell.cell_type == "code" for output in cell.outputs)


def test_the_tour_notebook_runs_top_to_bottom_and_its_claims_hold(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell that failed
    text = printed(notebook)
    for claim in CLAIMS:
        assert claim in text
    # 200 steps learn something: the mean loss of the last steps is well below the first.
    first, last = (float(v) for v in re.search(
        r"loss at step 0: ([\d.]+) .* mean of the last 20 steps: ([\d.]+)", text).groups())
    assert last < first - 1.0
    # Switching both MLPs off makes the prompt's loss worse (the last ablation line).
    losses = [float(v) for v in re.findall(r"^loss ([\d.]+), next after", text, re.MULTILINE)]
    assert len(losses) == 3 and losses[2] > losses[0]
    # ARENA's detector finds induction heads in the model trained on BOS + A + A, and zeroing
    # a head's values costs loss (a hook whose in-place edit was lost would cost none).
    assert re.search(r"^Induction heads =  \d\.\d", text, re.MULTILINE)
    added = re.search(r"loss added by zeroing each head's values \(layer x head\): (.*)$", text,
                      re.MULTILINE).group(1)
    assert max(float(v) for v in re.findall(r"-?[\d.]+", added)) > 0.05
