"""Processes: the `tidegate up` launcher, managed child processes, the tier
runtime, `tidegate status`."""
