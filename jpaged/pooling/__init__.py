"""The pooling runner (vLLM's `runner="pooling"`): embeddings, classification, scoring and reward
from encoder models (BERT, RoBERTa, XLM-RoBERTa) and from the decoder architectures, prefill only."""
