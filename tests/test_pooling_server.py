"""`jpaged serve --runner pooling` over real HTTP (a subprocess, as users run it): the openai SDK's
embeddings.create (float and base64), LangChain's OpenAIEmbeddings, /pooling, /classify, /score,
Jina's and Cohere's rerank against CrossEncoder.predict, /v1/models, /metrics, /tokenize, and the
bad inputs, each a 4xx naming the field."""

import base64
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest
import requests

pytest.importorskip("sentence_transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pooling_checkpoints import TEXTS, make_cross_encoder, make_embedder  # noqa: E402

API_KEY = "pool-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Server:
    def __init__(self, model: str, *flags: str):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", model, "--port", "0",
                                      "--served-model-name", "m", "--api-key", API_KEY, *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log, self.url, self.ready = [], None, threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if self.url is None and line.startswith("jpaged: serving"):
                self.url = line.split(" at ")[1].split("/v1")[0]
                self.ready.set()
        self.ready.set()

    def wait(self):
        if not self.ready.wait(300) or self.url is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        return self

    def post(self, path, body, auth=True):
        return requests.post(self.url + path, json=body, headers=AUTH if auth else {}, timeout=60)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pooling_server"))
    embedder, reranker = make_embedder(root, "bert", "mean"), make_cross_encoder(root, "xlm-roberta")
    # Both start at once (the checkpoints' loads and compiles overlap).
    started = [Server(embedder, "--runner", "pooling"), Server(reranker)]
    yield {"embed": started[0].wait(), "rerank": started[1].wait(), "embed_path": embedder,
           "rerank_path": reranker}
    for s in started:
        assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def reference(servers):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(servers["embed_path"], device="cpu")


def test_openai_sdk_float_and_base64(servers, reference):
    client = openai.OpenAI(base_url=servers["embed"].url + "/v1", api_key=API_KEY, max_retries=0)
    ref = reference.encode(TEXTS)
    # No encoding_format: the SDK asks for base64 and decodes it; asked for, base64 comes back as it is.
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        res = client.embeddings.create(model="m", input=TEXTS, encoding_format=fmt)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
                        for d in res.data])
        assert [d.index for d in res.data] == list(range(len(TEXTS)))
        assert ((got * ref).sum(1) >= 0.9999).all()
        assert res.usage.prompt_tokens == res.usage.total_tokens == sum(
            len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    ids = reference.tokenizer(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model="m", input=[ids], encoding_format="float", user="u1")
    np.testing.assert_allclose(by_ids.data[0].embedding, ref[1], atol=1e-5)


def test_langchain_openai_embeddings(servers, reference):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="m", base_url=servers["embed"].url + "/v1", api_key=API_KEY,
                           check_embedding_ctx_length=False)  # (else it sends tiktoken's ids)
    docs = emb.embed_documents(TEXTS[:3])
    query = emb.embed_query(TEXTS[3])
    ref = reference.encode(TEXTS[:4])
    assert ((np.array(docs + [query]) * ref).sum(1) >= 0.9999).all()


def test_pooling_score_tokenize_models_metrics(servers, reference):
    s = servers["embed"]
    pooled = s.post("/pooling", {"model": "m", "input": TEXTS[:2]}).json()
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], reference.encode(TEXTS[:2]), atol=1e-5)
    score = s.post("/score", {"model": "m", "text_1": TEXTS[0], "text_2": TEXTS[:3]}).json()
    ref = reference.encode(TEXTS[:3])
    np.testing.assert_allclose([d["score"] for d in score["data"]], ref[0] @ ref.T, atol=1e-5)
    tok = s.post("/tokenize", {"prompt": TEXTS[0]}).json()
    assert tok["tokens"] == reference.tokenizer(TEXTS[0])["input_ids"]
    models = requests.get(s.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["id"] == "m" and models["data"][0]["max_model_len"] == 128
    metrics = requests.get(s.url + "/metrics", timeout=10).text
    assert "jpaged:prompt_tokens_total" in metrics
    assert s.post("/v1/embeddings", {"input": "x"}, auth=False).status_code == 401


def test_health_has_the_generation_servers_body(servers):
    """Issue 60: /health was a 200 with an empty body; it is the generation server's JSON (a pooling
    engine has no warm-up to wait for: ready from the start), with no API key needed."""
    for name in ("embed", "rerank"):
        r = requests.get(servers[name].url + "/health", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json"), r.text
        assert r.json() == {"status": "ok", "ready": True}, r.text


def test_rerank_jina_and_cohere_match_cross_encoder(servers):
    from sentence_transformers import CrossEncoder

    s = servers["rerank"]
    query, docs = "capital of france", TEXTS[:5]
    ref = CrossEncoder(servers["rerank_path"], device="cpu").predict([(query, d) for d in docs])
    jina = s.post("/rerank", {"model": "m", "query": query, "documents": docs, "top_n": 3}).json()
    assert [r["index"] for r in jina["results"]] == list(np.argsort(-ref)[:3])
    np.testing.assert_allclose([r["relevance_score"] for r in jina["results"]], np.sort(ref)[::-1][:3], atol=1e-4)
    assert jina["results"][0]["document"]["text"] == docs[jina["results"][0]["index"]]
    # Cohere's request (v2: documents as strings; v1 clients send {"text": ...} objects).
    for path, documents in (("/v2/rerank", docs), ("/v1/rerank", [{"text": d} for d in docs])):
        cohere = s.post(path, {"model": "m", "query": query, "documents": documents, "top_n": 5,
                               "return_documents": False}).json()
        got = {r["index"]: r["relevance_score"] for r in cohere["results"]}
        np.testing.assert_allclose([got[i] for i in range(5)], ref, atol=1e-4)
        assert "document" not in cohere["results"][0]
    classify = s.post("/classify", {"model": "m", "input": docs[:2]}).json()
    assert classify["data"][0]["num_classes"] == 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": ["a", 3]}, "input"),
    ("/v1/embeddings", {"input": ["hello"] * 3000}, "input"),
    ("/v1/embeddings", {"input": [[1, 10 ** 6]]}, "input"),
    ("/v1/embeddings", {"input": " ".join(["hello"] * 200)}, "input"),
    ("/v1/embeddings", {"input": "hello", "truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "hello", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hello", "model": "other"}, "model"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["b", "c", "d"]}, "text_1"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/classify", {"input": "hello"}, "model"),
])
def test_bad_inputs_are_4xx_naming_the_field(servers, path, body, param):
    r = servers["embed"].post(path, body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_truncation_and_generation_refused(servers, reference):
    s = servers["embed"]
    long = " ".join(["hello"] * 200)
    r = s.post("/v1/embeddings", {"input": long, "truncate_prompt_tokens": 16}).json()
    ids = reference.tokenizer(long)["input_ids"][-16:]
    direct = s.post("/v1/embeddings", {"input": [ids]}).json()
    np.testing.assert_allclose(r["data"][0]["embedding"], direct["data"][0]["embedding"], atol=1e-6)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = s.post(path, {"model": "m", "prompt": "hi"})
        assert r.status_code == 400 and "runner='pooling'" in r.json()["error"]["message"]


def test_concurrent_requests_pack_together(servers, reference):
    """Requests that arrive while a forward runs share the next one; each gets its own inputs' embeddings."""
    import concurrent.futures

    s = servers["embed"]
    bodies = [{"model": "m", "input": TEXTS[i:i + 2]} for i in range(len(TEXTS) - 1)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: s.post("/v1/embeddings", b).json(), bodies))
    ref = reference.encode(TEXTS)
    for i, reply in enumerate(replies):
        got = np.array([d["embedding"] for d in reply["data"]])
        assert ((got * ref[i:i + 2]).sum(1) >= 0.9999).all()
