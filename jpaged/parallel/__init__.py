"""Tensor parallelism (mesh + sharding rules) and multi-host coordination."""

from jpaged.parallel.sharding import (LOGICAL_AXIS_RULES, TP_AXIS, kv_cache_sharding, kv_head_replicas,
                                      logical_sharding, make_mesh, replicated, tp_size)

__all__ = ["LOGICAL_AXIS_RULES", "TP_AXIS", "kv_cache_sharding", "kv_head_replicas", "logical_sharding", "make_mesh",
           "replicated", "tp_size"]
