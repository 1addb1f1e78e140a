"""The rollout engine's side of RL training (vLLM's names): new weights from memory, sleep and
wake, prefix-cache reset. The runner owns weights and KV pool (jpaged/runner/weights.py), the
block manager the prefix cache; these functions order the two, and run only between requests
(an update under a running request would mix weights within its sequence). `LLM` and the
server's routes (serving/sleep.py) call them with the engine.
"""

import logging

import jax
from flax import nnx

from jpaged.models.loader import load_model_of
from jpaged.quantization.scheme import device_bytes
from jpaged.runner import weights

logger = logging.getLogger(__name__)


def _check_idle(engine, what: str):
    if jax.process_count() > 1:
        raise ValueError(f"{what} is not supported across several hosts yet")
    if engine.has_unfinished_requests():
        raise ValueError(f"{what}: requests are unfinished; wait for them or abort them first")


def is_sleeping(engine) -> bool:
    return engine.runner.slept is not None


def load_weights(engine, named_weights):
    """Write Hugging Face-named tensors into the model (all of them checked first: a rejected call
    changes nothing); the prefix cache is reset. While asleep the weights come back to the
    devices (after sleep level 2 every tensor must be given), the KV pool stays freed."""
    _check_idle(engine, "load_weights")
    runner = engine.runner
    dropped = runner.state is None and runner.slept.host_state is None
    checked = weights.check_weights(weights.model_of(runner), named_weights, require_all=dropped)
    if runner.state is None:
        weights.restore_weights(runner)
    weights.write_weights(runner, checked, runner.dtype, runner.mesh)
    engine.block_manager.reset_prefix_cache()
    engine.publish_kv_events()
    logger.info("load_weights: %d tensor(s) written", len(checked))


def sleep(engine, level: int = 1):
    """Free the KV pool and the weights on the devices: level 1 keeps a host copy of the weights,
    level 2 drops them (load_weights, or wake_up reading the checkpoint again, brings them back)."""
    if not engine.config.enable_sleep_mode:
        raise ValueError("sleep needs enable_sleep_mode=True (--enable-sleep-mode)")
    if level not in (1, 2):
        raise ValueError(f"level={level!r}; expected 1 or 2")
    if is_sleeping(engine):
        raise ValueError("the engine is already asleep")
    _check_idle(engine, "sleep")
    engine.runner.proposer.check_sleep()
    engine.wait_for_warmup()  # the background compiles read the weights' and pages' shapes
    if level == 2 and engine.lora_manager is not None:
        raise ValueError("sleep(level=2) is not supported with enable_lora: the adapters' slots would be lost")
    before = device_bytes((engine.runner.state, engine.runner.kv_cache))
    weights.sleep(engine.runner, level)
    engine.block_manager.reset_prefix_cache()  # the pages are gone
    engine.publish_kv_events()
    logger.info("sleep(level=%d): %.1f MiB freed on the devices", level, before / 2**20)


def wake_up(engine):
    """Weights (from the host copy, or the checkpoint read again) and a zeroed KV pool back on the
    devices; nothing when awake. A checkpoint that cannot be read again (truncated, replaced by
    another model's) is a ValueError naming the file, and leaves the engine asleep as it was."""
    if not is_sleeping(engine):
        return
    runner, state = engine.runner, None
    try:
        if runner.state is None and runner.slept.host_state is None:  # level 2 and no load_weights since
            state = nnx.split(load_model_of(engine.config).model)[1]
        weights.wake_up(runner, state)
    except ValueError as e:  # nothing changed: still asleep, and wake_up may be called again
        if state is not None and runner.state is not state:
            weights.free(state)
        raise ValueError(f"wake_up: reading the checkpoint again failed: {e}. The engine is still asleep: fix "
                         "the checkpoint and call wake_up again, or give every tensor with load_weights") from None
    logger.info("wake_up: %.1f MiB on the devices", device_bytes((runner.state, runner.kv_cache)) / 2**20)


def reset_prefix_cache(engine):
    _check_idle(engine, "reset_prefix_cache")
    engine.block_manager.reset_prefix_cache()
    engine.publish_kv_events()
