"""A worker's services: the engine on its own thread, prefill and decode logic, publishing, metrics."""
