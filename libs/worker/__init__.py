"""What the prefill and decode worker services share: settings, the engine thread, KV endpoint, heartbeats."""
