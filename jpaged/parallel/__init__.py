"""Tensor parallelism (mesh + sharding rules) and multi-host coordination."""
