"""The hook API every other room of `glassgpt.interp` stands on, importing nothing else of it:
`hooked.py` (`run_with_cache`, `run_with_hooks`, `zero_heads`: read and replace the hook points
of `glassgpt.hooks`), `cache.py` (`ActivationCache`), `resid.py` (the cached stream split into
what wrote it), `stream.py` (the stream entering a norm as a sum of parts, the norm's scale
frozen), `names.py` (`stop_at_layer`), `utils.py` (TransformerLens's `utils`: `get_act_name`,
`to_numpy`) and `checks.py` (the indices and traces the methods are given).
"""
