"""What the pooling methods return, with vLLM's names: a PoolingRequestOutput per input whose
`outputs` is the task's own (EmbeddingOutput.embedding, ClassificationOutput.probs,
ScoringOutput.score, PoolingOutput.data)."""

import dataclasses
from typing import Generic, TypeVar

import numpy as np


@dataclasses.dataclass
class PoolingOutput:
    data: np.ndarray  # float32: [hidden] pooled, or [tokens, ...] for ALL pooling / reward


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ScoringOutput:
    score: float


T = TypeVar("T")


@dataclasses.dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    pass


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    pass


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
