"""Prefill worker: runs prompts (radix prefix cache) and writes their KV into decode workers' pages with Mooncake."""
