"""What the prefill and decode worker services share: settings, start-up (engine, KV endpoint), the service
base, the engine thread, heartbeats, wire conversions, KV cache events, prefix reuse, page accounting."""
