"""Quantized weights: fp8 / int8 on the fly, and compressed-tensors, AWQ and GPTQ checkpoints.

  scheme.py   WeightScheme, QuantizedTensor, quantize_model: how a Linear is quantized
  formats.py  Quantization and the checkpoint readers (quantization_config, tensor names)
"""
