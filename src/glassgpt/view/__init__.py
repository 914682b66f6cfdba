"""`glassgpt view RUN`: a local web page that shows what a trained model does with a prompt.

    inspector.py  `RunView`: tokens, attention (weights, scores, every layer and head), one
                  head step by step, top-k and the logit lens, ablation, sampling, the model
                  card, as JSON-ready values (torch only, no web code)
    traces.py     one forward pass over a prompt, kept (`Inside`, `TraceCache`)
    maps.py       attention maps as the page draws them: lower triangles, the keys a window
                  hides, colour scales, thumbnails
    causal.py     the panels that ask why: patching, logit attribution, head scores, inside
                  the MLP, q and k before QK-norm and the rotation (glassgpt.interp's numbers)
    walk.py       "Inside one head": the steps' titles (the scale, soft-cap and window this
                  layer uses) and the band of keys a local layer's query sees
    card.py       the model card's parameters by part, each layer's kind (local, global), a
                  LoRA tune's adapters and the training's settings and loss curve
    values.py     tensors as the page's JSON: rounded numbers, one step with its source line
    pieces.py     a token's text as the page shows it (`<0xE2>` for a byte of a character)
    timeline.py   the Timeline panel: the view of each snapshot the step slider asks for (the
                  last few kept loaded), and timeline.json's loss and head scores for the page
    requests.py   the API's request bodies: JSON objects, each field's type checked
    server.py     the Starlette app and the uvicorn server, `load_for_view`
    static/       the page: index.html, style.css, app.js and a script a panel (causal.js,
                  timeline.js, ...): no build step, nothing from a CDN

The numbers are `glassgpt.interp`'s (`lens`: the logit lens, top-k, every layer's attention;
`heads`: one head step by step), read from the model's hook points, usable without any of this.
"""
