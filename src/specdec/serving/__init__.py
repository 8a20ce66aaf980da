"""`specdec serve`: an OpenAI-compatible HTTP server with continuous batching across requests.

`scheduler` (the engine thread), `protocol` (request bodies and errors), specdec.detokenize (token ids to client text),
`metrics` (Prometheus text), `app` (the FastAPI routes), `cli` (the command). FastAPI and uvicorn are the
`serve` extra: `pip install 'specdec[serve]'`.
"""
