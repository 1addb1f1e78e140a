"""PoolingEngine: the pooling runner's engine. Inputs are tokenized and checked up front and go
through the generation engine's scheduler (core/scheduler.py) as prefill-only requests: each step
takes the waiting inputs FCFS, whole, within max_num_batched_tokens, packs them ragged
(jpaged/pooling/packed.py) into one prefill-only forward per kind (no decode, no KV pages kept),
pooled on the device (CLS, MEAN, LAST; ALL returns every token) and, for classifiers, through the
model's head. One compiled executable per (rows, row length) shape."""

import dataclasses
import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Sequence, SequenceGroup
from jpaged.models import loader
from jpaged.models.bert import ENCODER_REGISTRY
from jpaged.models.forward_context import forward_context
from jpaged.parallel import sharding
from jpaged.pooling.decoder import DECODER_REGISTRY, classifier_tokens, decoder_weight_names
from jpaged.pooling.packed import NoPages, PackedAttentionOps, build_batch, pack, packed_context
from jpaged.pooling.pooler_config import POOLING_TYPES, PoolerConfig, read_pooler_config
from jpaged.sampling_params import SamplingParams

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


@dataclasses.dataclass(frozen=True)
class PoolingTask:
    """What a pooling request's step computes: SequenceGroup.pooling."""

    input: PoolingInput
    pooling: str  # one of POOLING_TYPES
    head: bool  # the classifier's logits of the pooled state


_NO_SAMPLING = SamplingParams(max_tokens=1)


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
        from transformers import AutoTokenizer  # not at the top: `jpaged serve` imports this module

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
        # No KV pages: the block manager only satisfies the scheduler (pooling requests take no
        # blocks). A step's budget holds any one input whole (vLLM's rule without chunked prefill);
        # max_batch_tokens bounds each forward of it (a step may pack into several).
        step_tokens = max(self.max_batch_tokens, self.max_model_len)
        self.scheduler = Scheduler(BlockManager(block_size=16, num_gpu_blocks=1, num_cpu_blocks=0),
                                   max_num_seqs=min(config.max_num_seqs, step_tokens),
                                   max_num_batched_tokens=step_tokens, max_model_len=self.max_model_len)
        self._request_ids = itertools.count()
        self.num_steps = 0  # steps that ran a forward
        self.num_requests = 0
        self.num_prompt_tokens = 0
        logger.info("pooling model %s (%s): %s pooling, normalize=%s, max_model_len=%d", config.model, arch,
                    self.pooler_config.pooling_type, self.pooler_config.normalize, self.max_model_len)

    def stats(self) -> dict:
        """LLM.stats() of a pooling LLM (no KV pool): inputs and tokens pooled so far, the steps
        that ran them, and the scheduler's queues."""
        return {"num_requests": self.num_requests, "num_prompt_tokens": self.num_prompt_tokens,
                "num_steps": self.num_steps, "num_waiting": len(self.scheduler.waiting),
                "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_batch_tokens,
                "max_num_seqs": self.scheduler.max_num_seqs}

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

    # ------------------------------------------------------------------ requests and steps
    def add_request(self, request_id: str, inp: PoolingInput, pooling: str, head: bool = False):
        """Queue a checked input (`check`) for the scheduler."""
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling type {pooling!r}; expected one of {POOLING_TYPES}")
        group = SequenceGroup(request_id, [Sequence(self.scheduler.new_seq_id(), list(inp.token_ids))], _NO_SAMPLING,
                              arrival_time=0.0)
        group.pooling = PoolingTask(inp, pooling, head)
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str):
        self.scheduler.abort_seq_group(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def step(self) -> list[tuple[str, np.ndarray | Exception]]:
        """One scheduler step: (request id, its pooled output, or the error that ended it) for each
        request it finished. A forward that fails ends its own requests only."""
        plan = self.scheduler.schedule()
        done: list[tuple[str, np.ndarray | Exception]] = [
            (g.request_id, ValueError(f"an input of {g.seqs[0].get_len()} tokens is over max_model_len="
                                      f"{self.max_model_len}")) for g in plan.ignored_seq_groups]
        kinds: dict[tuple[str, bool], list] = {}
        for scheduled in plan.scheduled_seq_groups:
            self.scheduler.on_dispatched(scheduled)
            task = scheduled.seq_group.pooling
            kinds.setdefault((task.pooling, task.head), []).append(scheduled)
        results = []
        for (pooling, head), items in kinds.items():
            try:
                pooled = self._run_packed([s.seq_group.pooling.input for s in items], pooling, head)
            except Exception as e:  # noqa: BLE001 (handed to its requests; the engine keeps serving)
                logger.exception("a pooling forward failed")
                for s in items:
                    self.scheduler.abort_seq_group(s.seq_group.request_id)
                    done.append((s.seq_group.request_id, e))
                continue
            results += [(s, [pooled], k) for k, s in enumerate(items)]
        failed = self.scheduler.update_from_output(results)
        for scheduled, _, _ in results:
            group = scheduled.seq_group
            if group.request_id in failed:
                self.scheduler.abort_seq_group(group.request_id)
                done.append((group.request_id, failed[group.request_id][1]))
            else:
                done.append((group.request_id, group.pooled))
                self.num_requests += 1
                self.num_prompt_tokens += len(group.prompt_token_ids)
        self.num_steps += bool(results)
        return done

    def run(self, inputs: list[PoolingInput], pooling: str, head: bool = False) -> list[np.ndarray]:
        """Each input's pooled hidden state (float32 [hidden]; ALL: [tokens, hidden]); with `head`,
        the classifier's logits of the pooled state instead ([num_labels]; ALL: per token). Stepped
        to the end here (offline); the inputs join the queue in packing order (longest first, short
        ones beside them), so FCFS steps pack as tightly as one plan over all of them (a bad
        `pooling` fails at the first add_request, with nothing queued)."""
        if self.has_unfinished_requests():
            raise RuntimeError("PoolingEngine.run: the engine has requests of another caller in flight")
        order = [i for _, _, rows in pack([len(x.token_ids) for x in inputs], self.max_model_len,
                                          self.max_batch_tokens) for row in rows for i in row]
        index = {}
        for i in order:
            request_id = f"pool-{next(self._request_ids)}"
            index[request_id] = i
            self.add_request(request_id, inputs[i], pooling, head)
        results: list[np.ndarray | None] = [None] * len(inputs)
        while self.has_unfinished_requests():
            for request_id, result in self.step():
                if isinstance(result, Exception):
                    for other in index:
                        self.abort_request(other)
                    raise result
                results[index[request_id]] = result
        return results

    def _run_packed(self, inputs: list[PoolingInput], pooling: str, head: bool) -> list[np.ndarray]:
        """One step's inputs of one kind, packed ragged: usually one forward (more when packing
        leaves more rows than the token budget's)."""
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
