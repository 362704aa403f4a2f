"""Fault injection for tests: wrappers that run a tier with a fault patched
in from outside, so the product carries no test hooks."""
