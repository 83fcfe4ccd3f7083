"""The shared vocabulary of the cluster: what routers and workers both speak (no torch here)."""
