"""Multi-host serving: two processes on this machine (jax.distributed on 127.0.0.1, two CPU devices
each) run the tiny model with tensor_parallel_size=4 across both. Process 0 schedules, process 1
follows its steps; both return what one process with TP=1 returns, also under swap preemption,
copy-on-write and a grammar's deferred sampling, and a bad request raises on both; and with a draft
model, whose drafts after each step both run.

This file is also the worker: `python tests/test_multihost.py PROCESS_ID PORT OUT_JSON`.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8, enforce_eager=True,
              swap_space=0.002)
# Tiny's logits reach ~30 in magnitude: 1e-5 of that (see test_tensor_parallel.py).
LOGPROB_ATOL = 3e-4


def workload():
    import jpaged

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, size=rng.integers(5, 60)).tolist() for _ in range(6)]
    greedy = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    sampled = jpaged.SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=2)
    # A grammar: its steps behind a step in flight are a forward and a later sampler (deferred_sample.py), on both.
    guided = jpaged.SamplingParams(temperature=0, max_tokens=12, guided_regex="[a-z]{4,12}", logprobs=2)
    return prompts, [greedy] * 4 + [guided, sampled]


def summarize(outs) -> list:
    return [[(c.token_ids, [sorted(lp.items()) for lp in c.logprobs]) for c in o.outputs] for o in outs]


DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}


def worker(process_id: int, port: int, out_path: str, mode: str = "plain"):
    import jpaged

    if process_id == 0:  # by arguments
        distributed = dict(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=0)
    else:  # by the environment
        os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
        distributed = {}
    if mode == "draft":
        return draft_worker(out_path, distributed)
    # 16 blocks of 8 tokens cannot hold 4 sequences of up to 72 tokens: swap preemption.
    llm = jpaged.LLM("tiny", tensor_parallel_size=4, num_gpu_blocks_override=16, preemption_mode="swap",
                     **LIMITS, **distributed)
    result = broadcast_check(process_id)
    prompts, params = workload()
    runner, ops = llm.llm_engine.runner, {}
    run_op = runner._run_op

    def counting(op, args):  # the device operations each process ran
        ops[op] = ops.get(op, 0) + 1
        return run_op(op, args)

    runner._run_op = counting
    result.update(outputs=summarize(llm.generate(prompts, params, use_tqdm=False)),
                  num_preemptions=llm.stats()["num_preemptions"], ops=ops)
    try:
        llm.generate([[1, 2], []], use_tqdm=False)
    except ValueError as e:
        result["error"] = str(e)
    with open(out_path, "w") as f:
        json.dump(result, f)


def draft_worker(out_path: str, distributed: dict):
    """A draft model (the tiny model itself) across both processes: its drafts for each step are
    computed right after the step before (spec_decode/draft_ahead.py), a device operation the
    followers run too."""
    import jpaged

    llm = jpaged.LLM("tiny", tensor_parallel_size=4, speculative_config=DRAFT, **LIMITS, **distributed)
    runner, ops = llm.llm_engine.runner, {}
    run_op = runner._run_op

    def counting(op, args):
        ops[op] = ops.get(op, 0) + 1
        return run_op(op, args)

    runner._run_op = counting
    prompts, _ = workload()
    sp = jpaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    result = dict(outputs=[o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)], ops=ops)
    result.update({k: v for k, v in llm.stats().items() if k.startswith("spec_decode_num")})
    with open(out_path, "w") as f:
        json.dump(result, f)


def broadcast_check(process_id: int) -> dict:
    """Messages of many sizes (one spans four chunks) sent with the engine's broadcast: what every
    process receives, and how many executables jax compiled meanwhile (the collective was compiled
    when the engine started)."""
    import jax

    from jpaged.parallel import distributed

    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name"))

    rng = np.random.default_rng()  # each process draws its own: only process 0's may arrive
    sizes = [0, 10, distributed.BROADCAST_CHUNK - 20, 3 * distributed.BROADCAST_CHUNK + 5]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        received = [distributed.broadcast_object(rng.bytes(n)) for n in sizes]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return {"received": [r.hex() for r in received], "broadcast_compilations": compiled}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(tmp_path, mode: str = "plain") -> tuple[dict, dict]:
    """The worker in two processes: the leader's result and the follower's."""
    # (conftest's -O0 too: the processes compile as this one does)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path / f"{i}.json"), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return tuple(json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    import jax

    import jpaged
    from jpaged.parallel import distributed

    leader, follower = run_two_processes(tmp_path)

    assert leader["received"] == follower["received"]
    chunk = distributed.BROADCAST_CHUNK
    assert [len(r) // 2 for r in leader["received"]] == [0, 10, chunk - 20, 3 * chunk + 5]
    assert leader["broadcast_compilations"] == follower["broadcast_compilations"] == []
    assert leader["num_preemptions"] > 0  # only the driver schedules
    assert leader["ops"] == follower["ops"] and leader["ops"].get("run_forward", 0) > 0  # deferred samplings too
    assert leader["ops"]["run_forward"] == leader["ops"]["run_sample"]
    assert leader["outputs"] == follower["outputs"]
    assert leader["error"] == follower["error"] == "prompt is empty"

    assert jax.process_count() == 1
    prompts, params = workload()
    reference = summarize(jpaged.LLM("tiny", **LIMITS).generate(prompts, params, use_tqdm=False))
    for ref, out in zip(reference, leader["outputs"], strict=True):
        for (ref_ids, ref_lps), (ids, lps) in zip(ref, out, strict=True):
            assert ids == ref_ids
            for ref_lp, lp in zip(ref_lps, lps, strict=True):
                assert [t for t, _ in lp] == [t for t, _ in ref_lp]
                assert np.allclose([v for _, v in lp], [v for _, v in ref_lp], rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.slow
def test_two_processes_speculate_with_a_draft_model(tmp_path):
    """The draft model's drafts after each step run on both processes (the device operation
    `draft_ahead`, through the driver's dispatch): the same operations on both, every draft of
    the model as its own draft accepted, the outputs of one process without speculation."""
    import jpaged

    leader, follower = run_two_processes(tmp_path, "draft")
    assert leader["ops"] == follower["ops"] and leader["ops"].get("draft_ahead", 0) > 5
    assert leader["outputs"] == follower["outputs"]
    assert leader["spec_decode_num_accepted_tokens"] == leader["spec_decode_num_draft_tokens"] > 20
    prompts, _ = workload()
    sp = jpaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in jpaged.LLM("tiny", **LIMITS).generate(prompts, sp, use_tqdm=False)]
    assert leader["outputs"] == reference


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
