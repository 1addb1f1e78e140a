"""Which GPU traced code is for: jax's device, or an abstract mesh's when lowering without one."""

import jax


def targets_gpu() -> bool:
    """Whether traced code is for a GPU: jax's default backend's, or an abstract mesh's device
    (lowering for CUDA on a machine without one, as CI's readiness job does)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return (jax.default_backend() if device is None else device.platform) == "gpu"


# NVIDIA device kinds -> compute capability, for an abstract GPU (lowering without one: its
# device_kind is all there is). Longer names first: "A100" before "A10". A real GPU reports its own.
_COMPUTE_CAPABILITY = (("GH200", 9.0), ("H100", 9.0), ("H200", 9.0), ("H800", 9.0), ("H20", 9.0),
                       ("GB200", 10.0), ("B200", 10.0), ("GB300", 10.3), ("B300", 10.3),
                       ("A100", 8.0), ("A800", 8.0), ("A30", 8.0), ("A10", 8.6), ("A40", 8.6),
                       ("RTX 4090", 8.9), ("L40", 8.9), ("L4", 8.9), ("T4", 7.5), ("V100", 7.0))


def gpu_device() -> tuple[str, float] | None:
    """(device kind, compute capability) of the GPU traced code is for, or None off a GPU: the
    abstract mesh's device when lowering without one, else jax's first device."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None:
        if device.platform != "gpu":
            return None
        kind = device.device_kind
        cc = next((cc for name, cc in _COMPUTE_CAPABILITY if name in kind), None)
        if cc is None:
            raise ValueError(f"unknown abstract GPU {kind!r}: its compute capability is not known here")
        return kind, cc
    if jax.default_backend() != "gpu":
        return None
    device = jax.devices()[0]
    return device.device_kind, float(getattr(device, "compute_capability", "0"))


def e4m3_as_bits() -> bool:
    """Whether Triton must read float8_e4m3fn pages as bytes and widen them by arithmetic: it has
    no e4m3 conversion below sm_89 (an A100 is sm_80; e5m2 converts everywhere)."""
    gpu = gpu_device()
    return gpu is not None and gpu[1] < 8.9
