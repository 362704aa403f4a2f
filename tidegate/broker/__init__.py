"""NATS and JetStream plumbing: stream setup, pulling with credit, KV followers."""
