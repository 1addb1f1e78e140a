"""Host-side core: sequences, the KV block manager and the scheduler. Plain Python, no jax."""
