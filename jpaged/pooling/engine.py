"""PoolingEngine: the pooling runner's engine. Inputs are tokenized and checked up front, packed
ragged into batches (jpaged/pooling/packed.py), each batch one prefill-only forward (no decode, no
KV pages kept), pooled on the device (CLS, MEAN, LAST; ALL returns every token) and, for
classifiers, through the model's head. One compiled executable per (rows, row length) shape."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from jpaged.config import EngineConfig
from jpaged.models import loader
from jpaged.models.bert import ENCODER_REGISTRY
from jpaged.models.forward_context import forward_context
from jpaged.parallel import sharding
from jpaged.pooling.decoder import DECODER_REGISTRY, classifier_tokens, decoder_weight_names
from jpaged.pooling.packed import NoPages, PackedAttentionOps, build_batch, pack, packed_context
from jpaged.pooling.pooler_config import POOLING_TYPES, PoolerConfig, read_pooler_config

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS = 2048  # tokens of one pooling forward: on a CPU, 8192 ran ~1.5x slower (docs/PERF.md)


def is_pooling_checkpoint(hf_config) -> bool:
    """runner="auto": encoders and sequence classifiers are pooling models (vLLM decides the same way)."""
    archs = getattr(hf_config, "architectures", None) or []
    return any(a in ENCODER_REGISTRY or a.endswith("ForSequenceClassification") or a in DECODER_REGISTRY
               and not a.endswith("ForCausalLM") for a in archs)


@dataclasses.dataclass
class PoolingInput:
    token_ids: list[int]
    token_types: list[int] | None = None  # BERT's sentence A / B, for cross-encoder pairs


class PoolingEngine:
    """Loads a pooling model and runs pooling requests. `config.convert`: what a causal LM becomes."""

    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size must be 1 with runner='pooling'")
        if config.data_parallel_size != 1:
            raise ValueError("data_parallel_size must be 1 with runner='pooling'")
        self.config = config
        if config.model == "tiny":
            raise ValueError("runner='pooling' needs an embedding or classification checkpoint; the built-in "
                             "'tiny' is a generation model")
        model_dir = loader.resolve_model_dir(config.model, config.revision)
        loader.check_regular_files(model_dir)
        self.hf_config = hf_config = loader.read_hf_config(model_dir, config.hf_overrides)
        archs = getattr(hf_config, "architectures", None) or []
        arch = next((a for a in archs if a in ENCODER_REGISTRY or a in DECODER_REGISTRY), None)
        if arch is None:
            raise ValueError(f"runner='pooling': unsupported architecture {archs or hf_config.model_type!r}; "
                             f"supported: {', '.join(sorted({**ENCODER_REGISTRY, **DECODER_REGISTRY}))}")
        model_cls = ENCODER_REGISTRY.get(arch) or DECODER_REGISTRY[arch]
        self.is_encoder = model_cls.is_encoder
        self.is_classifier = hasattr(model_cls, "classify")
        if config.convert == "classify" and not self.is_classifier:
            raise ValueError(f"convert='classify': {arch} has no classification head; a *ForSequenceClassification "
                             "checkpoint is needed")
        self.convert = config.convert if config.convert not in (None, "auto", "none") else (
            "classify" if self.is_classifier else "embed")
        self.dtype = loader.resolve_dtype(config.dtype, hf_config)
        longest = (model_cls.max_positions(hf_config) if self.is_encoder
                   else getattr(hf_config, "max_position_embeddings", 2048))
        if config.max_model_len is not None and config.max_model_len > longest:
            raise ValueError(f"max_model_len={config.max_model_len} is over the model's {longest} positions")
        self.max_model_len = config.max_model_len or longest
        self.max_batch_tokens = max(config.max_num_batched_tokens or DEFAULT_MAX_BATCH_TOKENS, 16)
        self.pooler_config: PoolerConfig = read_pooler_config(model_dir, hf_config, self.is_encoder)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if getattr(hf_config, "classifier_from_token", None) is not None:  # a causal LM's LM-head rows as labels
            hf_config.classifier_token_ids, hf_config.num_labels = classifier_tokens(hf_config, self.tokenizer)
        self.vocab_size = hf_config.vocab_size
        self.num_labels = getattr(hf_config, "num_labels", 0) if self.is_classifier else 0
        mesh = sharding.make_mesh(1, config.devices)
        weights = loader.iter_safetensors(model_dir)
        if not self.is_encoder:
            weights = decoder_weight_names(weights)
        self.model = loader.build_model(hf_config, weights, dtype=self.dtype, mesh=mesh, model_cls=model_cls,
                                        ops=PackedAttentionOps(causal=True), max_model_len=self.max_model_len)
        graphdef, self.state = nnx.split(self.model)
        self._forward = jax.jit(functools.partial(_forward, graphdef, NoPages.of(hf_config.num_hidden_layers)),
                                static_argnames=("num_rows", "row_len", "num_seqs", "pooling", "head"))
        self.num_compiled_shapes = 0
        self.num_requests = 0
        self.num_prompt_tokens = 0
        logger.info("pooling model %s (%s): %s pooling, normalize=%s, max_model_len=%d", config.model, arch,
                    self.pooler_config.pooling_type, self.pooler_config.normalize, self.max_model_len)

    def stats(self) -> dict:
        """LLM.stats() of a pooling LLM (no KV pool, no scheduler): inputs and tokens pooled so far."""
        return {"num_requests": self.num_requests, "num_prompt_tokens": self.num_prompt_tokens,
                "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_batch_tokens}

    @property
    def classify_pooling(self) -> str:
        """Encoders classify their CLS token (ModernBERT: as its config says), decoders their last."""
        if hasattr(self.model, "classify_pooling"):
            return self.model.classify_pooling(self.hf_config)
        return "CLS" if self.is_encoder else "LAST"

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def tokenize(self, text: str, text_pair: str | None = None) -> PoolingInput:
        enc = self.tokenizer(text, text_pair) if text_pair is not None else self.tokenizer(text)
        # (a checkpoint with one token type, RoBERTa's, has no sentence B)
        types = enc.get("token_type_ids") if self.is_encoder and getattr(self.hf_config, "type_vocab_size", 1) > 1 \
            else None
        return PoolingInput(list(enc["input_ids"]), list(types) if types is not None else None)

    def check(self, inp: PoolingInput, truncate_prompt_tokens: int | None = None, field: str = "prompts"):
        """The input as it will run: token ids checked; over max_model_len a ValueError unless
        truncated (vLLM's truncate_prompt_tokens: keep the last k tokens; -1: max_model_len)."""
        ids = inp.token_ids
        if not ids:
            raise ValueError(f"{field}: an input is empty (no tokens)")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                   for t in ids):
            raise ValueError(f"{field}: token ids must be integers in [0, {self.vocab_size})")
        if truncate_prompt_tokens is not None:
            k = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if not (isinstance(k, int) and 1 <= k <= self.max_model_len):
                raise ValueError(f"truncate_prompt_tokens={truncate_prompt_tokens}; expected -1 or 1..max_model_len="
                                 f"{self.max_model_len}")
            if len(ids) > k:
                types = inp.token_types
                inp = PoolingInput(ids[-k:], None if types is None else types[-k:])
        if len(inp.token_ids) > self.max_model_len:
            raise ValueError(f"{field}: an input has {len(inp.token_ids)} tokens, over max_model_len="
                             f"{self.max_model_len} (truncate_prompt_tokens truncates it)")
        return inp

    def run(self, inputs: list[PoolingInput], pooling: str, head: bool = False) -> list[np.ndarray]:
        """Each input's pooled hidden state (float32 [hidden]; ALL: [tokens, hidden]); with `head`,
        the classifier's logits of the pooled state instead ([num_labels]; ALL: per token)."""
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling type {pooling!r}; expected one of {POOLING_TYPES}")
        results: list[np.ndarray | None] = [None] * len(inputs)
        token_ids = [i.token_ids for i in inputs]
        types = [i.token_types for i in inputs]
        for row_len, num_rows, rows in pack([len(t) for t in token_ids], self.max_model_len, self.max_batch_tokens):
            batch = build_batch(token_ids, types, row_len, num_rows, rows)
            num_seqs = 1 << (len(batch.items) - 1).bit_length()
            pad = num_seqs - len(batch.items)
            starts, lengths = (np.concatenate([a, np.zeros(pad, np.int32)]) for a in (batch.starts, batch.lengths))
            out = self._forward(self.state, batch.input_ids, batch.positions, batch.token_types, batch.segments,
                                starts, lengths, num_rows=num_rows, row_len=row_len, num_seqs=num_seqs,
                                pooling=pooling, head=head)
            out = np.asarray(jax.device_get(out))
            for k, i in enumerate(batch.items):
                results[i] = (out[batch.starts[k]:batch.starts[k] + batch.lengths[k]] if pooling == "ALL"
                              else out[k])
        self.num_requests += len(inputs)
        self.num_prompt_tokens += sum(map(len, token_ids))
        return results


def _forward(graphdef, no_pages, state, input_ids, positions, token_types, segments, starts, lengths, *,
             num_rows, row_len, num_seqs, pooling, head):
    model = nnx.merge(graphdef, state)
    with forward_context(packed_context(num_rows, row_len, segments)):
        if model.is_encoder:
            hidden, _ = model(input_ids, positions, no_pages, token_type_ids=token_types)
        else:
            hidden, _ = model(input_ids, positions, no_pages)
    hidden = hidden.astype(jnp.float32)
    if pooling == "ALL":
        return model.classify(hidden) if head else hidden
    if pooling == "CLS":
        pooled = hidden[starts]
    elif pooling == "LAST":
        pooled = hidden[starts + jnp.maximum(lengths, 1) - 1]
    else:  # MEAN over each input's tokens (padding's segment -1 is dropped)
        sums = jax.ops.segment_sum(hidden, segments, num_segments=num_seqs)
        pooled = sums / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    return model.classify(pooled.astype(model_dtype(model))) if head else pooled


def model_dtype(model):
    table = next(getattr(model, n) for n in ("embed_tokens", "word_embeddings", "tok_embeddings") if hasattr(model, n))
    return table.embedding.dtype


def resolve_runner(config: EngineConfig) -> str:
    """'generate' or 'pooling' for config.runner ('auto': from the checkpoint's architecture)."""
    if config.runner != "auto":
        return config.runner
    if config.convert not in ("auto", "none"):
        return "pooling"
    if config.model == "tiny":
        return "generate"
    try:
        model_dir = loader.resolve_model_dir(config.model, config.revision)
        return "pooling" if is_pooling_checkpoint(loader.read_hf_config(model_dir, config.hf_overrides)) else "generate"
    except ValueError:  # the generation engine reports an unreadable checkpoint as it always did
        return "generate"
