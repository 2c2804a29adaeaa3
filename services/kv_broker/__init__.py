"""kv-broker: worker registry and KV-handle leases, state in NATS JetStream KV."""
