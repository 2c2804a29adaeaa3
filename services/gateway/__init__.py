"""The gateway service: moemesh's OpenAI-compatible HTTP API (FastAPI), never importing torch. It validates,
applies the chat template, tokenizes, submits to the scheduler over NATS, detokenizes the streamed tokens
and answers as JSON or SSE. Run it with `python -m services.gateway`."""
