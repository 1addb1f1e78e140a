"""Model definitions (one file per architecture family) and the checkpoint loader."""

from jpaged.models.layers import AttentionMetadata
from jpaged.models.loader import MODEL_REGISTRY, LoadedModel, load_model

__all__ = ["AttentionMetadata", "LoadedModel", "MODEL_REGISTRY", "load_model"]
