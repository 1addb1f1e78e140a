"""Quantized weights: fp8 / int8 on the fly, and compressed-tensors, AWQ and GPTQ checkpoints."""

from jpaged.quantization.formats import QUANTIZATION_METHODS, Quantization, quantization_of
from jpaged.quantization.scheme import QuantizedTensor, WeightScheme, model_memory_bytes, quantize_model

__all__ = ["QUANTIZATION_METHODS", "Quantization", "QuantizedTensor", "WeightScheme", "model_memory_bytes",
           "quantization_of", "quantize_model"]
