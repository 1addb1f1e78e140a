"""jpaged: PagedAttention LLM serving in JAX/Pallas, with vLLM's API."""

import os

# transformers advises installing PyTorch when it is absent ("PyTorch was not found. Models won't
# be available..."): jpaged needs only its tokenizers and configs. Only transformers' advisory
# warnings are off; its warnings are not. Set before anything imports transformers.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jpaged.lora.request import LoRARequest
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "generate", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and generate pull in jax and transformers: imported on first use, so that `jpaged --help`
    # and code that only needs SamplingParams or EngineConfig start at once.
    if name in ("LLM", "generate"):
        from jpaged import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
