"""The device platform the engine runs on: the `device` option, checked loudly at start-up.
Which of its devices an engine uses is `EngineConfig.devices` (jpaged/parallel/sharding.py).

jax falls back to the CPU without a word when its CUDA plugin fails to load; with
device="cuda" that is an error here instead of a server that never touches its GPU.
"""

import jax
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent

import pallas_kernels

PLATFORMS = {"cuda": "gpu", "cpu": "cpu"}  # device option -> jax.default_backend()


def select(device: str | None):
    """Before jax starts its backends: device="cpu" keeps jax off a GPU that is present."""
    if device == "cpu" and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def check(device: str | None):
    """RuntimeError unless jax's default backend is `device`'s (None: any)."""
    if device is None:
        return
    if device == "cuda":
        try:
            jax.devices("cuda")
        except RuntimeError as e:
            raise RuntimeError(f"device='cuda' but jax has no CUDA backend ({e}). Install jax's CUDA plugin "
                               "(pip install 'jpaged[cuda12]' or 'jpaged[cuda13]') and check that "
                               "`python -c 'import jax; print(jax.devices())'` lists the GPU") from e
    backend = jax.default_backend()
    if backend != PLATFORMS[device]:
        raise RuntimeError(f"device={device!r} but jax already runs on {backend!r}: set JAX_PLATFORMS={device} "
                           "before anything in the process starts jax")


def describe(attention_backend: str, devices: list | None = None) -> str:
    """Backend, the engine's devices (default: all of jax's) and the attention kernels that will
    run, for the start-up log."""
    devices = jax.devices() if devices is None else devices
    family = pallas_kernels.kernel_family(attention_backend)
    kernels = {"pallas": "Pallas/Triton", "mosaic": "Pallas/Mosaic GPU", "xla": "XLA"}[family]
    if family != "xla" and not pallas_kernels.targets_gpu():
        kernels += " (interpret mode)"
    reason = pallas_kernels.backend_reason(attention_backend)
    kernels += f": {reason}" if reason else ""
    return (f"{jax.default_backend()} ({devices[0].device_kind} x{len(devices)}: devices "
            f"{','.join(str(d.id) for d in devices)}), attention {attention_backend!r} -> {kernels}")
