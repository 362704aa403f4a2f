"""Control data in NATS KV: API keys, quota policies, the workers registry,
queue stats, the admin commands."""
