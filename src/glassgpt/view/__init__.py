"""`glassgpt view RUN`: a local web page that shows what a trained model does with a prompt.

    inspector.py  `RunView`: tokens, attention, top-k and the logit lens, sampling, the model
                  card, as JSON-ready values (torch only, no web code)
    requests.py   the API's request bodies: JSON objects, each field's type checked
    server.py     the Starlette app and the uvicorn server, `load_for_view`
    bench.py      `python -m glassgpt.view.bench`: the API's response times
    static/       the page: index.html, style.css, app.js (no build step, nothing from a CDN)

The computations themselves are `glassgpt.lens`, usable from Python without any of this.
"""
