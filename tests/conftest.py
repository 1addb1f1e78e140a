import os

# Debug mode: every engine the tests build checks its block pool's invariants after every step.
os.environ.setdefault("JPAGED_CHECK_INVARIANTS", "1")

# Eight CPU devices (set before jax is imported), so tensor-parallel tests can build meshes of
# 2, 4 and 8 on any machine; single-device code keeps using the first one.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
