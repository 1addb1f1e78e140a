"""Model definitions (one file per architecture family) and the checkpoint loader."""

from jpaged.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from jpaged.models.loader import MODEL_REGISTRY, LoadedModel, load_model

__all__ = ["AttentionMetadata", "ForwardContext", "forward_context", "LoadedModel", "MODEL_REGISTRY", "load_model"]
