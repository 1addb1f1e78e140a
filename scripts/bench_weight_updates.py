"""load_weights and sleep / wake_up on a Llama-3.2-1B-shaped random bf16 model (or --model).

    python scripts/bench_weight_updates.py --save-dir /tmp/llama1b

Times `LLM.load_weights` with every tensor of the checkpoint from numpy (host -> devices) and
from jax arrays already on the devices (a trainer's parameters), each several times (median);
then the live device bytes awake, asleep (level 1 and 2) and after wake_up, and how long each
takes. Prints markdown for docs/PERF.md.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def live_device_bytes() -> int:
    import jax

    buffers = {}
    for x in jax.live_arrays():
        for shard in x.addressable_shards:  # each buffer once
            buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return sum(buffers.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (default: a random 1B-shaped Llama)")
    parser.add_argument("--save-dir", default="/tmp/jpaged-llama1b", help="where the random checkpoint is kept")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import jax

    import jpaged
    from jpaged.models.loader import iter_safetensors
    from scripts.bench_models import build_random_llama

    model = args.model
    if model is None:
        model = args.save_dir
        if not os.path.exists(os.path.join(model, "config.json")):
            build_random_llama("1b", model, seed=0)
    tensors = dict(iter_safetensors(model))
    n_bytes = sum(t.nbytes for t in tensors.values())
    llm = jpaged.LLM(model, max_model_len=256, max_num_seqs=4, enforce_eager=True, enable_sleep_mode=True,
                     num_gpu_blocks_override=512)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    before = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    print(f"{model}: {len(tensors)} tensors, {n_bytes / 2**30:.2f} GiB in the checkpoint; "
          f"{jax.device_count()} {jax.default_backend()} device(s)\n")

    def timed(fn, repeats=args.repeats):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            jax.block_until_ready(llm.llm_engine.runner.state)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    on_device = {k: jax.device_put(v) for k, v in tensors.items()}
    jax.block_until_ready(on_device)
    numpy_s = timed(lambda: llm.load_weights(tensors))
    jax_s = timed(lambda: llm.load_weights(on_device))
    del on_device
    print("| load_weights, every tensor | seconds (median) | GB/s |")
    print("|---|---|---|")
    print(f"| from numpy | {numpy_s:.2f} | {n_bytes / numpy_s / 1e9:.2f} |")
    print(f"| from jax arrays on the devices | {jax_s:.2f} | {n_bytes / jax_s / 1e9:.2f} |")
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == before

    stats = llm.stats()
    print(f"\nweights {stats['model_memory_bytes'] / 2**20:.0f} MiB, KV pool {stats['kv_cache_bytes'] / 2**20:.0f} MiB\n")
    print("| state | live device MiB | seconds to get there |")
    print("|---|---|---|")
    print(f"| awake | {live_device_bytes() / 2**20:.0f} | |")
    for level in (1, 2):
        t0 = time.perf_counter()
        llm.sleep(level)
        print(f"| asleep, level {level} | {live_device_bytes() / 2**20:.0f} | {time.perf_counter() - t0:.2f} |")
        t0 = time.perf_counter()
        llm.wake_up()
        jax.block_until_ready(llm.llm_engine.runner.state)
        woke = time.perf_counter() - t0
        same = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == before
        how = "host copy" if level == 1 else "checkpoint read again"
        print(f"| woken from level {level} ({how}) | {live_device_bytes() / 2**20:.0f} | {woke:.2f} "
              f"(same greedy tokens: {same}) |")


if __name__ == "__main__":
    main()
