"""The engine's GPU memory plan at its DEFAULT settings, for an H100 80GB or an H200, on a machine
with no GPU: XLA compiles the engine's executables for the target (deviceless, from XLA's target
description in scripts/gpu_targets, or $JPAGED_GPU_TARGETS) and reports each one's real GPU memory.

    JAX_PLATFORMS=cpu python scripts/gpu_memory_plan.py --target h100|h200 --model llama-3.2-1b|llama-3.1-8b

Needs jax with the CUDA plugin (`pip install "jax[cuda13]==0.11.2"`, Python 3.12; see
scripts/gpu_targets/README.md). Weights are abstract (Llama-3.2-1B / Llama-3.1-8B shapes in bf16,
nothing downloaded). Steps:
1. The engine's memory probe (runner/step_memory.py): its largest executables compiled on an
   abstract runner of the default shapes (max_num_seqs 256, max_num_batched_tokens 2048, the
   model's max_model_len 131072): each one's argument, output, alias and temp bytes.
2. The pool the engine's planner (engine/kv_pool_size.py) would pick, from jax's memory on the
   target (--mem-fraction of the device, as XLA_PYTHON_CLIENT_MEM_FRACTION; jax saw 104.9 GiB of
   an H200 at 0.75 on the first GPU run) minus the weights.
3. The largest forward and the full sampler compiled again with the planned pool: their transient
   bytes must not grow with the pool (beyond the plan's margin or 0.1% of the pool: no temporary
   the pool's size), and the forward must update the pool in place (aliased).
Exit 1 when weights + step state + the peak transient + the pool exceed the budget, or step 3 fails.
"""

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's own sort instead of CUB's (whose scratch needs a device to size): temp is approximate for sorts.
if "xla_gpu_deviceless_cub_mode" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deviceless_cub_mode=DEVICELESS_CUB_DISABLED").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from jpaged.engine import start_up  # noqa: E402
from jpaged.engine.kv_pool_size import GIB, plan_gpu_memory  # noqa: E402
from jpaged.engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS  # noqa: E402
from jpaged.models.kv_cache import KVCacheSpec  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402
from jpaged.models.loader import LoadedModel  # noqa: E402
from jpaged.models.paged_attention import AttentionOps  # noqa: E402
from jpaged.models.stacked import unroll_layers_on_gpu  # noqa: E402
from jpaged.parallel import sharding  # noqa: E402
from jpaged.runner import step_memory  # noqa: E402
from jpaged.runner.executable_cache import ExecutableCache  # noqa: E402
from jpaged.runner.model_runner import ModelRunner  # noqa: E402

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
# What jax 0.11.2 reported as bytes_limit over 0.75 x the device's memory on the H200 (104.9 GiB
# of 0.75 x 141.0 GiB): the CUDA context and driver reserve take the rest.
SEEN_LIMIT_RATIO = 104.9 / (0.75 * 151397597184 / GIB)
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
MODELS = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling={**LLAMA3_ROPE, "factor": 32.0}),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}),
}


def target_mesh(target: str):
    """A one-device tensor-parallel mesh of the abstract target GPU, and the device's memory in bytes."""
    from jax.experimental import topologies

    directory = os.environ.get("JPAGED_GPU_TARGETS", os.path.join(ROOT, "scripts", "gpu_targets"))
    text = open(os.path.join(directory, TARGETS[target])).read()
    topology = topologies.get_topology_desc("gpu", "cuda", target_config=text, topology="1x1x1")
    memory = int(text.split("device_memory_size:")[1].split()[0])
    return jax.sharding.Mesh(topology.devices, (sharding.TP_AXIS,)), memory


def abstract_model(name: str, mesh) -> LoadedModel:
    """The model's weights as shapes on the mesh (bf16), as the loader would place them."""
    config = LlamaConfig(max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         bos_token_id=128000, eos_token_id=128001, architectures=["LlamaForCausalLM"],
                         **MODELS[name])
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.bfloat16, ops=AttentionOps("auto", mesh),
                                                    max_model_len=config.max_position_embeddings))
    unroll_layers_on_gpu(model, mesh)  # as the loader does on a GPU
    weights = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct):
            value = node.get_value()
            axes = getattr(node, "logical_axes", None) or (None,) * len(value.shape)
            node.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=sharding.logical_sharding(mesh, axes, value.shape)))
            weights += value.size * value.dtype.itemsize
    return LoadedModel(model, config, None, jnp.dtype(jnp.bfloat16), mesh, model_memory_bytes=weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), required=True)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--mem-fraction", type=float, default=0.75, help="XLA_PYTHON_CLIENT_MEM_FRACTION (jax: 0.75)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()

    start = time.perf_counter()
    mesh, device_memory = target_mesh(args.target)
    loaded = abstract_model(args.model, mesh)
    max_model_len = loaded.hf_config.max_position_embeddings  # the engine's default: the model's limit
    spec = KVCacheSpec.of_model(loaded.model, 16, jnp.bfloat16)
    shape = dict(max_num_seqs=args.max_num_seqs, max_model_len=max_model_len, num_speculative_tokens=0,
                 max_num_batched_tokens=max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs))
    limit = int(args.mem_fraction * device_memory * SEEN_LIMIT_RATIO)
    print(f"jax {jax.__version__}: {mesh.devices.flat[0].device_kind}, {device_memory / GIB:.1f} GiB, jax's share "
          f"{limit / GIB:.1f} GiB (fraction {args.mem_fraction}); {args.model} bf16, weights "
          f"{loaded.model_memory_bytes / GIB:.2f} GiB; max_num_seqs {shape['max_num_seqs']}, max_num_batched_tokens "
          f"{shape['max_num_batched_tokens']}, max_model_len {max_model_len}, block_size 16")

    def runner_of(num_blocks: int) -> ModelRunner:
        return ModelRunner(loaded, spec, **shape, num_gpu_blocks=num_blocks, num_cpu_blocks=0,
                           executable_cache=ExecutableCache(None, ""), abstract=True)

    def compile_on_target(runner, key):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # Pallas lowers for the abstract GPU
            jitted, jit_args = runner._jitted_and_args(key)
            return jitted.trace(*jit_args).lower().compile()

    # 1. The probe, as the engine runs it.
    probe = runner_of(start_up.PROBE_BLOCKS)
    steps = step_memory.measure(probe, compile_fn=functools.partial(compile_on_target, probe))
    mib = lambda n: f"{n / 2**20:10.1f}"  # noqa: E731
    print(f"\n{'executable':28} {'args MiB':>10} {'out MiB':>10} {'alias MiB':>10} {'temp MiB':>10} {'transient':>10}")
    for s in steps:
        print(f"{' '.join(map(str, s.key)):28} {mib(s.argument)} {mib(s.output)} {mib(s.alias)} {mib(s.temp)} "
              f"{mib(s.transient)}")
    top = step_memory.peak(steps)

    # 2. The plan.
    state = start_up.step_state_bytes(shape["max_num_seqs"], max_model_len)
    stats = {"bytes_limit": limit, "bytes_in_use": loaded.model_memory_bytes}
    num_blocks, plan = plan_gpu_memory(bytes_per_block=spec.bytes_per_block,
                                       gpu_memory_utilization=args.gpu_memory_utilization, memory_stats=stats,
                                       step_state=state, peak=top.transient, peak_of=" ".join(map(str, top.key)))
    print(f"\nplan: {plan.describe()}\n      {num_blocks} blocks of {spec.bytes_per_block / 1024:.0f} KiB "
          f"({num_blocks * 16} tokens)")
    failures = []
    used = loaded.model_memory_bytes + state + top.transient + plan.pool
    if used > limit * args.gpu_memory_utilization:
        failures.append(f"weights + step state + peak + pool = {used / GIB:.2f} GiB exceed the budget "
                        f"{limit * args.gpu_memory_utilization / GIB:.2f} GiB")

    # 3. The largest forward and the full sampler at the planned pool.
    final = runner_of(num_blocks)
    by_key = {s.key: s for s in steps}
    pool_bytes = 2 * final.kv_cache.k_pages.size * final.kv_cache.k_pages.dtype.itemsize
    for key in (step_memory.memory_keys(final)[0], ("sample", final.buckets.rows[-1], True)):
        again = step_memory.measure(final, [key], functools.partial(compile_on_target, final))[0]
        grew = again.transient - by_key[key].transient
        print(f"at the planned pool: {' '.join(map(str, key))}: transient {mib(again.transient).strip()} MiB "
              f"({grew:+d} bytes against the probe's), alias {again.alias / GIB:.2f} GiB")
        # What this guards against is a temporary the size of the pool (a second copy of it): growth
        # in GiB. XLA's choices can step by a few MiB once the pool passes 2^31 elements (unrolled
        # layers on an H200: +12 MiB at 184k blocks, none up to 4k); the plan's margin takes that.
        if grew > min(plan.margin, pool_bytes // 1000):
            failures.append(f"{key}: its transient bytes grew by {grew} with the pool's size")
        if key[0] == "forward" and again.alias < pool_bytes:
            failures.append(f"{key}: the pool is not updated in place (aliased {again.alias} of {pool_bytes} bytes)")
        if loaded.model_memory_bytes + state + again.transient + plan.pool > limit * args.gpu_memory_utilization:
            failures.append(f"{key} at the planned pool exceeds the budget")
    print(f"\n{time.perf_counter() - start:.0f} s; " + ("OK" if not failures else "FAILED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
