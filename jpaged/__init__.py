"""jpaged: PagedAttention LLM serving in JAX/Pallas, with vLLM's API."""

from jpaged.llm import LLM, generate
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams

__all__ = ["LLM", "generate", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
