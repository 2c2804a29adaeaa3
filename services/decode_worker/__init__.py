"""Decode worker: continuous-batching decode; receives prompt KV from prefill workers (or prefills short prompts itself)."""
