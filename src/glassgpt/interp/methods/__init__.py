"""Asking a model why, on the hook API of `glassgpt.interp.core` (and, to steer by a latent, the
dictionaries of `glassgpt.interp.sae`): `lens.py` (the logit lens, top-k, every layer's weights
and scores, ablation), `heads.py` (one head step by step), `attribution.py` (direct logit
attribution), `patching/` (TransformerLens's activation patching), `attribution_patching.py`
(its gradient approximation), `scores.py` (head scores, `detect_head`), `steering.py` (a
direction added while sampling) and `diffing.py` (what a fine-tune changed against its base).
"""
