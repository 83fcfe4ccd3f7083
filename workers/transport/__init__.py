"""KV transports: write a prefill worker's KV blocks into a decode worker's cache."""
