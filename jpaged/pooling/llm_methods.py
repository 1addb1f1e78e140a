"""The pooling methods of jpaged.LLM, with vLLM's names and arguments: embed, classify, score,
reward and encode. They run on a PoolingEngine (LLM(model, runner="pooling"))."""

import dataclasses

import numpy as np

from jpaged.pooling.engine import PoolingEngine, PoolingInput
from jpaged.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                    EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                                    ScoringRequestOutput)


@dataclasses.dataclass
class PoolingParams:
    """vLLM's PoolingParams: `dimensions` (Matryoshka: the embedding's first n values), `normalize`
    (None: the checkpoint's), `truncate_prompt_tokens` (keep the last k tokens; -1: max_model_len)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None


def check_dimensions(engine: PoolingEngine, dimensions, field: str = "dimensions") -> None:
    if dimensions is None:
        return
    pc = engine.pooler_config
    if not pc.is_matryoshka:
        raise ValueError(f"{field}={dimensions}: the model does not support matryoshka representation "
                         "(its config has no is_matryoshka / matryoshka_dimensions)")
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= engine.hidden_size:
        raise ValueError(f"{field}={dimensions!r}; expected an integer in 1..{engine.hidden_size}")
    if pc.matryoshka_dimensions is not None and dimensions not in pc.matryoshka_dimensions:
        raise ValueError(f"{field}={dimensions}; the model supports {list(pc.matryoshka_dimensions)}")


def finish_embedding(engine: PoolingEngine, pooled: np.ndarray, dimensions: int | None,
                     normalize: bool | None) -> np.ndarray:
    """Matryoshka truncation, then L2 normalization (vLLM's order)."""
    x = pooled[..., :dimensions] if dimensions is not None else pooled
    if engine.pooler_config.normalize if normalize is None else normalize:
        x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return x


def activation(logits: np.ndarray) -> np.ndarray:
    """A classifier's probabilities: sigmoid for one label, else softmax (vLLM's, CrossEncoder's)."""
    logits = np.asarray(logits, np.float64)
    if logits.shape[-1] == 1:
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def as_inputs(engine: PoolingEngine, prompts, truncate_prompt_tokens=None, field: str = "prompts"):
    """str | list[int] | {"prompt": ...} | {"prompt_token_ids": ...}, or a list of them, as checked inputs."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{field}: expected a non-empty list of prompts")
    inputs = []
    for p in prompts:
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if isinstance(p, str):
            inp = engine.tokenize(p)
        elif isinstance(p, (list, tuple)):
            inp = PoolingInput(list(p))
        else:
            raise ValueError(f"{field}: a prompt must be a string or a list of token ids, got {type(p).__name__}")
        inputs.append(engine.check(inp, truncate_prompt_tokens, field))
    return inputs


class PoolingMethods:
    """Mixed into jpaged.LLM; `self.llm_engine` is a PoolingEngine when runner='pooling'."""

    def _pooling_engine(self, method: str) -> PoolingEngine:
        if not isinstance(self.llm_engine, PoolingEngine):
            raise ValueError(f"LLM.{method}() needs runner='pooling'; this LLM was started with runner='generate'")
        return self.llm_engine

    def _ids(self, n: int) -> list[str]:
        return [str(next(self._request_ids)) for _ in range(n)]

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, dimensions: int | None = None,
              normalize: bool | None = None, lora_request=None) -> list[EmbeddingRequestOutput]:
        engine = self._pooling_engine("embed")
        params = pooling_params or PoolingParams(dimensions, normalize, truncate_prompt_tokens)
        check_dimensions(engine, params.dimensions)
        inputs = as_inputs(engine, prompts, params.truncate_prompt_tokens)
        pooled = engine.run(inputs, engine.pooler_config.pooling_type)
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(
                    finish_embedding(engine, p, params.dimensions, params.normalize).tolist()), inp.token_ids)
                for rid, p, inp in zip(self._ids(len(inputs)), pooled, inputs)]

    def classify(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None, lora_request=None) -> list[ClassificationRequestOutput]:
        engine = self._classifier("classify")
        inputs = as_inputs(engine, prompts, truncate_prompt_tokens)
        logits = engine.run(inputs, engine.classify_pooling, head=True)
        return [ClassificationRequestOutput(rid, ClassificationOutput(activation(x).tolist()), inp.token_ids)
                for rid, x, inp in zip(self._ids(len(inputs)), logits, inputs)]

    def _classifier(self, method: str) -> PoolingEngine:
        engine = self._pooling_engine(method)
        if not engine.is_classifier:
            raise ValueError(f"LLM.{method}() needs a classification model (a *ForSequenceClassification "
                             "checkpoint); this one is an embedding model")
        return engine

    def score(self, data_1, data_2, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request=None) -> list[ScoringRequestOutput]:
        """Each (data_1[i], data_2[i]) pair's score; one data_1 is paired with every data_2. A
        cross-encoder (classifier) reads each pair together; an embedding model scores the cosine
        similarity of the two embeddings."""
        engine = self._pooling_engine("score")
        scores, pairs = score_pairs(engine, data_1, data_2, truncate_prompt_tokens)
        return [ScoringRequestOutput(rid, ScoringOutput(float(s)), ids)
                for rid, s, ids in zip(self._ids(len(scores)), scores, pairs)]

    def reward(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_params: PoolingParams | None = None, lora_request=None) -> list[PoolingRequestOutput]:
        """Per-token outputs: a classifier's logits for every token (reward models), else every
        token's hidden state."""
        return self.encode(prompts, pooling_task="token_classify" if self._pooling_engine("reward").is_classifier
                           else "token_embed", truncate_prompt_tokens=truncate_prompt_tokens)

    def encode(self, prompts, pooling_task: str = "embed", *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
               lora_request=None) -> list[PoolingRequestOutput]:
        """The raw pooled data (PoolingOutput.data): "embed" (the model's pooling), "token_embed"
        (every token's hidden state), "classify" / "token_classify" (logits)."""
        engine = self._pooling_engine("encode")
        tasks = {"embed": (engine.pooler_config.pooling_type, False), "token_embed": ("ALL", False),
                 "classify": (engine.classify_pooling, True), "token_classify": ("ALL", True)}
        if pooling_task not in tasks:
            raise ValueError(f"pooling_task={pooling_task!r}; expected one of {sorted(tasks)}")
        pooling, head = tasks[pooling_task]
        if head:
            self._classifier("encode")
        inputs = as_inputs(engine, prompts, truncate_prompt_tokens)
        data = engine.run(inputs, pooling, head=head)
        return [PoolingRequestOutput(rid, PoolingOutput(d), inp.token_ids)
                for rid, d, inp in zip(self._ids(len(inputs)), data, inputs)]


def score_pairs(engine: PoolingEngine, data_1, data_2, truncate_prompt_tokens=None, field_1: str = "data_1",
                field_2: str = "data_2") -> tuple[list[float], list[list[int]]]:
    """Scores of the pairs (data_1 broadcast when it is one text) and each pair's token ids."""
    one = [data_1] if isinstance(data_1, str) else list(data_1) if isinstance(data_1, (list, tuple)) else None
    two = [data_2] if isinstance(data_2, str) else list(data_2) if isinstance(data_2, (list, tuple)) else None
    for name, texts in ((field_1, one), (field_2, two)):
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name}: expected a text or a non-empty list of texts")
    if len(one) == 1:
        one = one * len(two)
    if len(one) != len(two):
        raise ValueError(f"{field_1} has {len(one)} texts and {field_2} {len(two)}; expected one or as many")
    if engine.is_classifier:
        inputs = [engine.check(engine.tokenize(a, b), truncate_prompt_tokens, field_2) for a, b in zip(one, two)]
        logits = engine.run(inputs, engine.classify_pooling, head=True)
        return [float(activation(x)[0]) for x in logits], [i.token_ids for i in inputs]
    uniq = list(dict.fromkeys(one + two))
    inputs = [engine.check(engine.tokenize(t), truncate_prompt_tokens, field_2) for t in uniq]
    emb = {t: finish_embedding(engine, p, None, True)
           for t, p in zip(uniq, engine.run(inputs, engine.pooler_config.pooling_type))}
    ids = {t: i.token_ids for t, i in zip(uniq, inputs)}
    return [float(np.dot(emb[a], emb[b])) for a, b in zip(one, two)], [ids[a] + ids[b] for a, b in zip(one, two)]
