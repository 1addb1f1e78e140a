"""An engine runs on the devices it is given (EngineConfig.devices), on the 8 CPU devices of
tests/conftest.py: two engines in one process on disjoint devices generate side by side, from two
threads at once, each with its own pool on its own devices, and each equals the same engine run
alone (greedy and seeded sampling, token for token). A bad `devices` is a ValueError naming it;
the command line reads `--devices 2,3`; the executable cache never loads an executable compiled
for other devices."""

import argparse
import threading

import jax
import jax.numpy as jnp
import pytest

import jpaged
from jpaged.config import EngineConfig
from jpaged.runner.executable_cache import ExecutableCache
from serving.cli import add_engine_args, engine_kwargs

LIMITS = dict(dtype="float32", block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=48, swap_space=0.002, enforce_eager=True, executable_cache=False)
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 7], [33, 34, 35, 36, 37, 38, 39], [120, 121]]
PARAMS = [jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          jpaged.SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True),
          jpaged.SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
          jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]


def generate(llm: jpaged.LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def arrays_of(llm: jpaged.LLM) -> list[jax.Array]:
    """What the engine keeps on devices: its KV pool, its weights and its per-row sampling state."""
    runner = llm.llm_engine.runner
    leaves = jax.tree.leaves(runner.kv_cache) + jax.tree.leaves(runner.state)
    leaves += [runner.last_tokens, runner.token_history]
    return [leaf for leaf in leaves if isinstance(leaf, jax.Array)]


def side_by_side(devices_a: list[int], devices_b: list[int], tp: int):
    """Both engines' outputs run alone, then from two threads at once; and what they allocated."""
    live_before = {id(a) for a in jax.live_arrays()}
    engines = [jpaged.LLM("tiny", tensor_parallel_size=tp, devices=devices, **LIMITS)
               for devices in (devices_a, devices_b)]
    alone = [generate(llm) for llm in engines]
    together, errors = [None, None], []
    start = threading.Barrier(2)

    def run(i: int):
        try:
            start.wait()
            for _ in range(2):  # long enough that the two overlap
                together[i] = generate(engines[i])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    created = [a for a in jax.live_arrays() if id(a) not in live_before]
    return engines, alone, together, created


@pytest.mark.parametrize("tp,devices_a,devices_b", [(1, [0], [1]), (2, [2, 3], [4, 5])])
def test_two_engines_on_disjoint_devices_generate_side_by_side(tp, devices_a, devices_b):
    engines, alone, together, created = side_by_side(devices_a, devices_b, tp)
    for llm, devices in zip(engines, (devices_a, devices_b)):
        wanted = {jax.devices()[i] for i in devices}
        assert llm.llm_engine.devices == [jax.devices()[i] for i in devices]
        assert {d.id for d in llm.llm_engine.runner.mesh.devices.flat} == set(devices)
        pool = llm.llm_engine.runner.kv_cache
        assert pool.k_pages.sharding.device_set == wanted and pool.v_pages.sharding.device_set == wanted
        for array in arrays_of(llm):
            assert array.sharding.device_set == wanted
    # Each pool is the engine's own: the same size, other buffers.
    pools = [llm.llm_engine.runner.kv_cache.k_pages for llm in engines]
    assert pools[0].shape == pools[1].shape and pools[0].sharding.device_set.isdisjoint(pools[1].sharding.device_set)
    # Nothing the two engines keep landed on a device neither was given (device 0 by default).
    given = {jax.devices()[i] for i in devices_a + devices_b}
    assert all(a.sharding.device_set <= given for a in created)
    # Each run side by side equals the same engine alone; the two engines (same model, same seeds) agree.
    assert together == alone
    assert alone[0] == alone[1]
    assert all(len(ids) == 12 for ids in alone[0])


def test_explicit_devices_equal_the_default_engine():
    """Engines on device 6 (with LoRA slots) and 7 (with a draft model) compute what the default
    engine (device 0) computes, token for token, and keep everything, the LoRA slots and the draft's
    weights and pool included, on their device."""
    default = jpaged.LLM("tiny", **LIMITS)
    assert default.llm_engine.devices == [jax.devices()[0]]
    reference = generate(default)
    six, seven = jax.devices()[6], jax.devices()[7]
    with_lora = jpaged.LLM("tiny", devices=[six], enable_lora=True, **LIMITS)  # a jax Device works as an id does
    lora_slots = [leaf for path, leaf in jax.tree.leaves_with_path(with_lora.llm_engine.runner.state)
                  if "lora_a" in jax.tree_util.keystr(path) or "lora_b" in jax.tree_util.keystr(path)]
    assert lora_slots and all(slot.sharding.device_set == {six} for slot in lora_slots)
    assert all(array.sharding.device_set == {six} for array in arrays_of(with_lora))
    assert generate(with_lora) == reference
    draft = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}
    with_draft = jpaged.LLM("tiny", devices=[7], speculative_config=draft, **LIMITS)
    draft_runner = with_draft.llm_engine.proposer.runner
    assert [d.id for d in draft_runner.mesh.devices.flat] == [7]
    draft_arrays = [a for a in jax.tree.leaves((draft_runner.kv_cache, draft_runner.state)) if isinstance(a, jax.Array)]
    assert all(a.sharding.device_set == {seven} for a in draft_arrays + arrays_of(with_draft))
    assert generate(with_draft) == reference
    assert with_draft.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("kwargs,why", [
    (dict(devices=[0, 0], tensor_parallel_size=2), "distinct"),
    (dict(devices=[0, 1]), "tensor_parallel_size=1"),
    (dict(devices=[99]), "no device 99"),
    (dict(devices=[1], tensor_parallel_size=2), "tensor_parallel_size=2"),
])
def test_bad_devices_are_a_value_error_naming_the_field(kwargs, why):
    with pytest.raises(ValueError, match="devices=") as e:
        jpaged.LLM("tiny", **LIMITS, **kwargs)
    assert why in str(e.value)


@pytest.mark.parametrize("devices", ["a,b", [-1], [True], [0.5], "1;2", object()])
def test_malformed_devices_are_refused_by_the_config(devices):
    with pytest.raises(ValueError, match="devices="):
        EngineConfig(devices=devices)


def test_devices_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--devices", "2,3", "--tensor-parallel-size", "2"])
    config = EngineConfig(**engine_kwargs(args))
    assert config.devices == [2, 3] and config.tensor_parallel_size == 2
    assert EngineConfig(**engine_kwargs(parser.parse_args([]))).devices is None
    assert "--devices" in parser.format_help()


def test_executable_cache_keys_the_devices(tmp_path):
    """An executable compiled for device 2 is not loaded for device 3 (nor for the default set);
    for device 2 again it is."""
    def args_on(device):
        return (jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)),)

    jitted = jax.jit(lambda x: x * 2 + 1)
    two, three = jax.devices()[2], jax.devices()[3]
    compiled = ExecutableCache(str(tmp_path), "m", [two]).compile("step", jitted, args_on(two))
    assert compiled.runtime_executable().local_devices() == [two]
    for devices in ([three], None):
        other = ExecutableCache(str(tmp_path), "m", devices)
        assert other.load("step", args_on(two)) is None and other.rejected == 0
    again = ExecutableCache(str(tmp_path), "m", [two])
    loaded = again.load("step", args_on(two))
    assert again.hits == 1
    x = jax.device_put(jnp.arange(8, dtype=jnp.float32), two)
    assert loaded(x).sharding.device_set == {two}
    assert list(loaded(x)) == [2 * i + 1 for i in range(8)]
