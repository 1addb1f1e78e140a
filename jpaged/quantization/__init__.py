"""Quantized weights: fp8 / int8 on the fly, and compressed-tensors, AWQ and GPTQ checkpoints."""

# jpaged.models first, whichever is imported first: scheme.py needs its Linear, and its loader
# imports this package.
import jpaged.models  # noqa: F401, I001

from jpaged.quantization.formats import QUANTIZATION_METHODS, Quantization, quantization_of
from jpaged.quantization.scheme import QuantizedTensor, WeightScheme, model_memory_bytes, quantize_model

__all__ = ["QUANTIZATION_METHODS", "Quantization", "QuantizedTensor", "WeightScheme", "model_memory_bytes",
           "quantization_of", "quantize_model"]
