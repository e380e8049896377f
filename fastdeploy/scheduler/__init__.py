"""Continuous batching: the scheduler and the paged KV cache it allocates from."""
