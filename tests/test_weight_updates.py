"""RL rollouts: new weights from memory, sleep and wake (jpaged/engine/sleep_mode.py).

Two tiny random Llama checkpoints A and B (transformers). An engine started on A generates what
transformers gives for A; after load_weights with B's tensors (numpy, torch, or jax arrays that
never leave the devices) it generates what transformers gives for B, with prefix caching on and
no step recompiled. Sleep frees the device memory and wake_up restores the same outputs; bad
tensors change nothing; the server's routes follow --enable-sleep-mode and --api-key.
"""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import hf_reference
import jpaged

SEED = 20261124
VOCAB = hf_reference.VOCAB
LIMITS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=True, enable_sleep_mode=True, background_warmup=False)
STEPS = 10


def prompts():
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    shared = rng.integers(3, VOCAB, 32).tolist()  # two full blocks: the second prompt hits the prefix cache
    return [shared + rng.integers(3, VOCAB, 5).tolist(), shared + rng.integers(3, VOCAB, 9).tolist()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"A": dir, "B": dir}: the same architecture, different random weights."""
    return {name: hf_reference.save_random_llama(tmp_path_factory.mktemp(name), SEED + i)
            for i, name in enumerate("AB")}


def tensors(path) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def hf_greedy(weights: dict, like: str):
    """transformers' greedy tokens for `like`'s architecture holding `weights`."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(like)).eval()
    model.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
    return hf_reference.hf_greedy(model, prompts(), STEPS)


def greedy(llm):
    sp = jpaged.SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    # One at a time: the second prompt's shared blocks come from the prefix cache.
    return [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts()]


def live_device_bytes() -> int:
    """Bytes of every live jax array, each buffer once (one CPU device)."""
    return sum({x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays() if len(x.devices()) == 1}.values())


def test_load_weights_switches_checkpoints_without_compiling(checkpoints):
    import torch

    from test_compilation import CompileRecorder

    a, b = tensors(checkpoints["A"]), tensors(checkpoints["B"])
    expected_a, expected_b = hf_greedy(a, checkpoints["A"]), hf_greedy(b, checkpoints["A"])
    assert expected_a != expected_b
    llm = jpaged.LLM(checkpoints["A"], **LIMITS)
    assert greedy(llm) == expected_a
    assert llm.stats()["prefix_cache_hits"] > 0
    compiled = llm.stats()["num_compilations"]
    with CompileRecorder() as recorder:
        llm.load_weights(b)  # numpy, a dict
        assert greedy(llm) == expected_b
        llm.load_weights([(k, torch.tensor(v).to(torch.bfloat16)) for k, v in a.items()])  # torch bf16, pairs
        assert greedy(llm) == hf_greedy({k: torch.tensor(v).bfloat16().float().numpy() for k, v in a.items()},
                                        checkpoints["A"])
        on_device = {k: jax.device_put(v) for k, v in b.items()}
        with jax.transfer_guard_device_to_host("disallow"):  # jax arrays never come back to the host
            llm.load_weights(on_device)
        assert greedy(llm) == expected_b
        mixed = {**a, **{k: v for k, v in b.items() if ".mlp." in k}}  # a partial update: B's MLPs into A
        llm.load_weights(a)
        llm.load_weights({k: v for k, v in b.items() if ".mlp." in k})
        assert greedy(llm) == hf_greedy(mixed, checkpoints["A"])
    assert llm.stats()["num_compilations"] == compiled
    steps = [e for e in recorder.events if any(s in e for s in ("forward", "multi_step", "sample"))]
    assert steps == [], recorder.events


def test_bad_tensors_change_nothing(checkpoints):
    b = tensors(checkpoints["B"])
    llm = jpaged.LLM(checkpoints["A"], **LIMITS)
    before = greedy(llm)
    norm = "model.layers.0.input_layernorm.weight"
    cases = {
        "no tensor": {"model.layers.0.self_attn.q.weight": b["model.layers.0.self_attn.q_proj.weight"]},
        "shape": {norm: np.ones(63, np.float32)},
        "dtype": {norm: np.ones(64, np.int32)},
        "expected a numpy": {norm: [1.0] * 64},
        "no tensors given": {},
        "'model.layers.0.input_layernorm.weight' holds NaN": {norm: np.full(64, np.nan, np.float32)},
        "'model.layers.1.mlp.up_proj.weight' holds NaN or infinite": {  # checked on the device
            "model.layers.1.mlp.up_proj.weight": jax.device_put(b["model.layers.1.mlp.up_proj.weight"]).at[2, 3].set(
                np.inf)},
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.load_weights({**b, **bad} if bad else bad)  # B's good tensors come first: none may land
    with pytest.raises(ValueError, match="twice"):
        llm.load_weights([(norm, b[norm]), (norm, b[norm])])
    assert greedy(llm) == before


def test_sleep_and_wake_up(checkpoints):
    a, b = tensors(checkpoints["A"]), tensors(checkpoints["B"])
    llm = jpaged.LLM(checkpoints["A"], **LIMITS)
    before = greedy(llm)
    kv_bytes, model_bytes = llm.stats()["kv_cache_bytes"], llm.stats()["model_memory_bytes"]
    assert kv_bytes > 0
    awake = live_device_bytes()
    for level in (1, 2):
        llm.sleep(level)
        assert llm.is_sleeping() and llm.stats()["kv_cache_bytes"] == 0
        asleep = live_device_bytes()
        print(f"level {level}: {awake} -> {asleep} live device bytes (KV {kv_bytes}, weights {model_bytes})")
        assert awake - asleep >= kv_bytes + model_bytes
        with pytest.raises(ValueError, match="asleep"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
        with pytest.raises(ValueError, match="already asleep"):
            llm.sleep(1)
        llm.wake_up()  # level 2: the checkpoint read again
        assert not llm.is_sleeping() and llm.stats()["kv_cache_bytes"] == kv_bytes
        assert greedy(llm) == before
    # Level 2, then B's weights from memory while asleep (all of them: nothing else is left), as
    # jax arrays the caller keeps: the engine holds copies, so its next sleep frees none of them.
    llm.sleep(2)
    with pytest.raises(ValueError, match="every tensor"):
        llm.load_weights({k: v for k, v in b.items() if ".mlp." in k})
    trainer = {k: jax.device_put(v) for k, v in b.items()}
    llm.load_weights(trainer)
    assert llm.is_sleeping()
    llm.wake_up()
    assert greedy(llm) == hf_greedy(b, checkpoints["A"])
    llm.sleep(1)
    assert not any(x.is_deleted() for x in trainer.values())
    llm.wake_up()
    # Not while requests run; not without enable_sleep_mode.
    llm.llm_engine.add_request("running", prompts()[0], jpaged.SamplingParams(max_tokens=4))
    for call in (lambda: llm.sleep(1), lambda: llm.load_weights(a), llm.reset_prefix_cache):
        with pytest.raises(ValueError, match="unfinished"):
            call()
    llm.llm_engine.abort_request("running")
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        jpaged.LLM(checkpoints["A"], **{**LIMITS, "enable_sleep_mode": False}).sleep(1)


def test_wake_up_from_a_broken_checkpoint_stays_asleep(checkpoints, tmp_path):
    """Sleep level 2 drops the weights; wake_up reads the checkpoint again. Truncated, or replaced
    by another model's, it is a ValueError naming the file, the engine still asleep; once the file
    is fixed wake_up works and the outputs are the same."""
    import shutil

    path = str(tmp_path / "A")
    shutil.copytree(checkpoints["A"], path)
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    llm = jpaged.LLM(path, **LIMITS)
    before = greedy(llm)
    llm.sleep(2)
    open(file, "wb").write(data[:len(data) * 2 // 3])
    with pytest.raises(ValueError, match=rf"wake_up: .*{file}: tensor .* \(truncated\).* still asleep"):
        llm.wake_up()
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="asleep"):
        greedy(llm)
    hf_reference.save_random_llama(tmp_path / "deeper", SEED, num_hidden_layers=3)  # the same names, one more layer
    shutil.copy(tmp_path / "deeper" / "model.safetensors", file)
    shutil.copy(tmp_path / "deeper" / "config.json", os.path.join(path, "config.json"))
    with pytest.raises(ValueError, match="wake_up: .*the model was started with .* still asleep"):
        llm.wake_up()
    assert llm.is_sleeping()
    shutil.copy(os.path.join(checkpoints["A"], "config.json"), os.path.join(path, "config.json"))
    open(file, "wb").write(data)
    llm.wake_up()
    assert not llm.is_sleeping() and greedy(llm) == before


def test_server_sleep_routes(checkpoints, tmp_path):
    import httpx

    from test_server import Server

    import shutil

    model = str(tmp_path / "A")  # a copy: truncated below
    shutil.copytree(checkpoints["A"], model)
    args = ["--model", model, "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--enable-prefix-caching", "--enforce-eager"]
    server = Server(*args, "--enable-sleep-mode", "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    try:
        def call(method, path, key=auth, **kw):
            return httpx.request(method, server.url + path, headers=key, timeout=120, **kw)

        def complete():
            r = call("POST", "/v1/completions", json={"model": model, "prompt": prompts()[0],
                                                      "max_tokens": 6, "temperature": 0})
            return r.status_code, r.json()

        status, first = complete()
        assert status == 200
        assert call("GET", "/is_sleeping").json() == {"is_sleeping": False}
        assert call("POST", "/sleep?level=1", key={}).status_code == 401
        for query in ("level=3", "level=1%20", "level=1&level=2", "level=01", "level="):
            r = call("POST", "/sleep?" + query)
            assert r.status_code == 400 and r.json()["error"]["param"] == "level", (query, r.text)
        assert call("POST", "/sleep?level=1").status_code == 200
        assert call("GET", "/is_sleeping").json() == {"is_sleeping": True}
        status, body = complete()
        assert status == 400 and "asleep" in body["error"]["message"]
        assert call("POST", "/sleep").status_code == 400  # already asleep
        assert call("POST", "/wake_up").status_code == 200
        status, again = complete()
        assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"]
        assert call("POST", "/reset_prefix_cache").status_code == 200
        # Level 2, the checkpoint truncated meanwhile: wake_up is a 400 naming the file, still asleep.
        file = os.path.join(model, "model.safetensors")
        data = open(file, "rb").read()
        assert call("POST", "/sleep?level=2").status_code == 200
        open(file, "wb").write(data[:len(data) // 2])
        r = call("POST", "/wake_up")
        assert r.status_code == 400 and f"{file}: tensor" in r.json()["error"]["message"], r.text
        assert call("GET", "/is_sleeping").json() == {"is_sleeping": True}
        open(file, "wb").write(data)
        assert call("POST", "/wake_up").status_code == 200
        status, again = complete()
        assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        assert server.stop() == 0
    server = Server(*args)
    try:
        r = httpx.post(server.url + "/sleep?level=1", timeout=60)
        assert r.status_code == 404 and "--enable-sleep-mode" in r.json()["error"]["message"]
    finally:
        assert server.stop() == 0
