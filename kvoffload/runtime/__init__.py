"""The serving process: the engine loop that drives a manager and a transfer handler, and the
workloads (trace replay, built-in synthetic) that feed it."""
