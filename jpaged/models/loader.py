"""Checkpoint loading: the one place that turns a model name into a Flax model with weights.

`model` is "tiny" (built in), a local Hugging Face directory (config.json, *.safetensors,
optionally sharded with model.safetensors.index.json, tokenizer files) or a hub id fetched
with huggingface_hub. The model is first built abstractly (shapes only); tensors are then
streamed one at a time from the files, converted to our layout and placed on the devices of
the tensor-parallel mesh, each device receiving only its own slice (sharding rules in
jpaged/parallel), so the host never holds two copies of the weights. A decoder layer's tensor
is written in place into its slice of the layer-stacked weight.
"""

import dataclasses
import logging
import math
import os
import re
import stat
from typing import TYPE_CHECKING, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jpaged import config
from jpaged.file_safety import open_regular, read_json, safetensors_header
from jpaged.models.gemma import GemmaForCausalLM
from jpaged.models.gemma3_mm import Gemma3ForConditionalGeneration
from jpaged.models.layers import Attention, Embedding, LayerNorm, Linear, RMSNorm, WeightTarget, kernel_path
from jpaged.models.gpt2 import GPT2LMHeadModel
from jpaged.models.paged_attention import AttentionOps
from jpaged.models.llama import LlamaForCausalLM
from jpaged.models.llava import LlavaForConditionalGeneration
from jpaged.models.moe import MixtralForCausalLM, SparseMoE
from jpaged.models.opt import OPTForCausalLM
from jpaged.models.phi3 import Phi3ForCausalLM
from jpaged.models.qwen2_vl import Qwen2VLForConditionalGeneration
from jpaged.models.stacked import unroll_layers_on_gpu
from jpaged.parallel import sharding
from jpaged.quantization.formats import Quantization, quantization_of
from jpaged.quantization.scheme import QuantizedTensor, check_scales, layout, model_memory_bytes, quantize_model
from pallas_kernels import invariant

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# AutoConfig and AutoTokenizer are imported where a checkpoint is read: importing them (any class under
# transformers.models) indexes that package's ~1,700 files (about 0.4 s), which `tiny` does not need.

logger = logging.getLogger(__name__)

# HF `architectures` name -> model class. Each class lives in its own file under models/.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": MixtralForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}

DTYPES = {name: jnp.dtype(name) for name in config.DTYPES if name != "auto"}


@dataclasses.dataclass
class LoadedModel:
    model: nnx.Module
    hf_config: "PretrainedConfig"
    tokenizer: object | None  # a transformers tokenizer, or None when the checkpoint has none
    dtype: jnp.dtype
    mesh: jax.sharding.Mesh  # the tensor-parallel mesh the weights are placed on
    # fp8 KV cache scales from the checkpoint (compressed-tensors' self_attn.k_scale / v_scale):
    # (k, v) f32[num_layers], or None when it has none.
    kv_scales: tuple[np.ndarray, np.ndarray] | None = None
    quantization: Quantization | None = None  # of the Linear layers' weights (None: the activation dtype)
    model_memory_bytes: int = 0  # the weights' device bytes, all devices
    processor: object | None = None  # a multimodal checkpoint's transformers AutoProcessor (images -> pixels)


# An fp8 KV cache's per-layer scales in a checkpoint (compressed-tensors, ModelOpt): layer index, k or v.
KV_SCALE_REACH = 448.0  # fp8 e4m3's largest value: the checkpoints' KV scales are calibrated for it
KV_SCALE = re.compile(r".*\.(?:layers|h)\.(\d+)\.[a-z_]+\.(k_scale|v_scale)")


def kv_scales_of(found: dict[tuple[int, str], float]) -> tuple[np.ndarray, np.ndarray] | None:
    """The per-layer (k, v) scales from {(layer, "k_scale" | "v_scale"): value}; every layer must have both."""
    if not found:
        return None
    num_layers = 1 + max(layer for layer, _ in found)
    missing = [f"layer {i} {kind}" for i in range(num_layers) for kind in ("k_scale", "v_scale")
               if (i, kind) not in found]
    if missing:
        raise ValueError(f"the checkpoint's KV cache scales are incomplete: no {', '.join(missing[:4])}")
    scales = [np.array([found[i, kind] for i in range(num_layers)], np.float32) for kind in ("k_scale", "v_scale")]
    if not all(np.isfinite(s).all() and (s > 0).all() for s in scales):
        raise ValueError("the checkpoint's KV cache scales must be finite and > 0")
    return scales[0], scales[1]


def get_model_class(hf_config: "PretrainedConfig"):
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {archs or hf_config.model_type!r}; "
                     f"supported: {', '.join(sorted(MODEL_REGISTRY))}")


def resolve_dtype(dtype, hf_config: "PretrainedConfig") -> jnp.dtype:
    if dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
        dtype = str(dtype).removeprefix("torch.")
        if dtype not in DTYPES:  # e.g. a float64 config: compute in float32
            dtype = "float32"
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"dtype={dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
    return jnp.dtype(dtype)


def build_model(hf_config: "PretrainedConfig", weights: Iterable[tuple[str, np.ndarray]], *, dtype: jnp.dtype,
                attention_backend: str = "auto", mesh: jax.sharding.Mesh | None = None,
                max_model_len: int | None = None, kv_scales: dict | None = None,
                quantization: Quantization | None = None, batch_invariant: bool = False, model_cls=None,
                ops=None) -> nnx.Module:
    """Build the model for `hf_config` abstractly and fill it from (name, tensor) pairs in HF naming,
    each weight placed on `mesh` (default: the first device) by its logical axes. `max_model_len`
    (default: the model's own limit) is for models whose rotary embedding depends on it (LongRoPE).
    KV cache scale tensors go to `kv_scales` {(layer, "k_scale" | "v_scale"): value}.
    `quantization`: the Linear layers it names are stored quantized (read from the checkpoint's
    quantized tensors, or quantized here from float ones). `model_cls` and `ops` (the attention call
    site): the pooling runner's own (default: the registry's class, paged attention)."""
    model_cls = model_cls or get_model_class(hf_config)
    mesh = mesh or sharding.make_mesh(1)
    ops = ops or AttentionOps(attention_backend, mesh, batch_invariant)
    # Abstract: a tensor-parallel size the heads do not allow fails here, before any allocation.
    model = nnx.eval_shape(lambda: model_cls(hf_config, dtype=dtype, ops=ops, max_model_len=max_model_len))
    unroll_layers_on_gpu(model, mesh)
    if batch_invariant:  # every matmul in fixed row tiles (jpaged/models/batch_invariant.py)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, (Linear, Embedding, RMSNorm, LayerNorm, SparseMoE)):  # MoE: dense experts
                node.batch_invariant = True
            elif isinstance(node, Attention):
                heads, head_dim = node.q_proj.out_shape
                tiles = invariant.invariant_tiles(heads // node.k_proj.out_shape[0], head_dim)
                node.ops = dataclasses.replace(node.ops, invariant_tiles=tiles)
    quantized = {}
    if quantization is not None:
        quantized, modules = quantize_model(model, quantization)
        weights = quantization.read(weights, modules)
    specs = model.hf_weights()
    if rename := getattr(model_cls, "rename_hf_weight", None):  # (a multimodal checkpoint's name variants)
        weights = ((rename(name), tensor) for name, tensor in weights)
    ignored = [re.compile(p) for p in model_cls.ignored_hf_weights]
    seen = set()
    stacks = HostStacks(mesh)
    for name, tensor in weights:
        if name not in specs:
            if any(p.fullmatch(name) for p in ignored):
                continue
            if (match := KV_SCALE.fullmatch(name)) and np.size(tensor) == 1:
                check_scales(name, np.asarray(tensor, np.float32).reshape(()), KV_SCALE_REACH, dtype)
                if kv_scales is not None:
                    kv_scales[int(match[1]), match[2]] = float(np.asarray(tensor, np.float32).reshape(()))
                continue
            raise ValueError(f"unexpected tensor {name!r} (shape {tuple(tensor.shape)}) in checkpoint for "
                             f"{model_cls.__name__}")
        check_finite([(name, tensor)])
        for target in specs[name]:
            if tuple(tensor.shape) != target.hf_shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                                 f"expected {target.hf_shape}")
            linear = quantized.get(kernel_path(target.param, quantized))
            if isinstance(tensor, QuantizedTensor) and linear is None:
                raise ValueError(f"tensor {name!r} is quantized in the checkpoint; jpaged's {model_cls.__name__} "
                                 "keeps it in full precision")
            place(target, tensor, linear, dtype, mesh, stacks)
        seen.add(name)
    stacks.finish()
    if isinstance(cache := getattr(model, "encoder_cache", None), nnx.Variable):  # (not a weight: zeros, replicated)
        cache.set_value(sharding.put(np.zeros(cache.shape, cache.dtype), sharding.replicated(mesh)))
    missing = [f"{n} (shape {specs[n][0].hf_shape})" for n in specs if n not in seen]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {model_cls.__name__}: "
                         + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    return model


# A 16- or 8-bit float is NaN or infinite when its exponent bits are all ones (e4m3fn: only NaN,
# all but the sign bit ones): tested on the bits, several times faster than np.isfinite on ml_dtypes.
_NONFINITE_BITS = {np.dtype(np.float16): (np.uint16, 0x7C00, 0x7C00),
                   np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80, 0x7F80),
                   np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, 0x7F, 0x7F),
                   np.dtype(ml_dtypes.float8_e5m2): (np.uint8, 0x7C, 0x7C)}


def _host_finite(x: np.ndarray) -> bool:
    if x.dtype in _NONFINITE_BITS:
        view, mask, nonfinite = _NONFINITE_BITS[x.dtype]
        return not ((np.ascontiguousarray(x).view(view) & mask) == nonfinite).any()
    return bool(np.isfinite(x).all())


def check_finite(named) -> None:
    """ValueError naming the first float tensor of `named` [(name, tensor)] holding a NaN or an
    infinity (a model with one serves garbage). Host arrays are checked on the host (about 1 ns a
    value); jax arrays on their devices, only one bool each read back."""
    on_device = []  # (name, flag): the flags read back together, one transfer
    for name, tensor in named:
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.values  # its scales are checked with their bounds (check_scales)
        if isinstance(tensor, jax.Array):
            if jnp.issubdtype(tensor.dtype, jnp.floating):
                on_device.append((name, jnp.isfinite(tensor).all()))
            continue
        tensor = np.asarray(tensor)
        floating = np.issubdtype(tensor.dtype, np.floating) or tensor.dtype in _NONFINITE_BITS
        if floating and not _host_finite(tensor):
            raise ValueError(f"tensor {name!r} holds NaN or infinite values")
    if on_device:
        with jax.transfer_guard_device_to_host("allow"):  # the flags only; the tensors stay where they are
            flags = jax.device_get([flag for _, flag in on_device])
        if bad := [name for (name, _), ok in zip(on_device, flags) if not ok]:
            raise ValueError(f"tensor {bad[0]!r} holds NaN or infinite values")


def place(target: WeightTarget, tensor, linear: Linear | None, dtype, mesh: jax.sharding.Mesh,
          stacks: "HostStacks | None" = None):
    """Write one checkpoint tensor (numpy, or a jax array kept on the devices) where `target` says,
    converted to the model's layout and dtype; into `linear`'s quantized weights when it is one.
    `stacks`: layers' slices of stacked weights may be assembled there (build_model)."""
    if linear is not None:
        values = layout(linear, target, tensor)
    else:
        xp = jnp if isinstance(tensor, jax.Array) else np
        values = [(target.param, xp.asarray(target.convert(tensor)).astype(dtype))]
    for param, value in values:
        if target.layer is None:
            param.set_value(sharding.put(value, sharding.logical_sharding(mesh, param.logical_axes, value.shape)))
        else:
            index = (target.layer,) if target.expert is None else (target.layer, target.expert)
            if stacks is None or not stacks.set_slice(param, index, value):
                _set_slice(param, index, value, mesh)


# Stacked weights are assembled in host memory up to this many bytes in all, then put on their
# devices whole: no device-side slice update, which compiles once per (stack, slice) shape
# (17 compiles, ~1 s of a cached start of `tiny` on a 2-core CPU). Larger models fill the rest
# on the devices, slice by slice, without holding a copy of their weights in host memory.
HOST_STACKS_BYTES = 2 << 30


class HostStacks:
    """Stacked weights (a layer axis first) filled on the host while a checkpoint loads."""

    def __init__(self, mesh: jax.sharding.Mesh, limit: int | None = None):
        self.mesh = mesh
        self.limit = HOST_STACKS_BYTES if limit is None else limit
        self.buffers: list[tuple[nnx.Param, np.ndarray]] = []  # (a few dozen stacks: found by identity)
        self.nbytes = 0

    def set_slice(self, param: nnx.Param, index: tuple[int, ...], value) -> bool:
        """Write the slice here (True), or leave it to the devices (False: the stack is on them
        already, the value is a device array, or the host budget is spent)."""
        at = next((i for i, (p, _) in enumerate(self.buffers) if p is param), None)
        if at is not None and isinstance(value, jax.Array):  # (a device array for a stack begun here: it moves there)
            self._put(*self.buffers.pop(at))
            return False
        if at is None:
            stacked = param.get_value()
            nbytes = math.prod(stacked.shape) * np.dtype(stacked.dtype).itemsize
            if isinstance(stacked, jax.Array) or isinstance(value, jax.Array) or self.nbytes + nbytes > self.limit:
                return False
            self.buffers.append((param, np.zeros(stacked.shape, stacked.dtype)))
            self.nbytes += nbytes
        buffer = self.buffers[at if at is not None else -1][1]
        buffer[index] = np.asarray(value)
        return True

    def finish(self):
        for param, buffer in self.buffers:
            self._put(param, buffer)
        self.buffers.clear()

    def _put(self, param: nnx.Param, buffer: np.ndarray):
        param.set_value(sharding.put(buffer, sharding.logical_sharding(self.mesh, param.logical_axes, buffer.shape)))


# Writes one slice into a stacked weight in place (the stack is donated).
_update_slice = jax.jit(lambda stacked, index, value: stacked.at[index].set(value), donate_argnums=0)


def _set_slice(param: nnx.Param, index: tuple[int, ...], value: np.ndarray, mesh: jax.sharding.Mesh):
    """Fill slice `index` (a layer, or a layer's expert) of a stacked weight; the stack is
    allocated on its first slice."""
    stacked = param.get_value()
    if not isinstance(stacked, jax.Array):  # still abstract
        stacked = jnp.zeros(stacked.shape, stacked.dtype,
                            device=sharding.logical_sharding(mesh, param.logical_axes, stacked.shape))
    slice_sharding = sharding.logical_sharding(mesh, param.logical_axes[len(index):], value.shape)
    param.set_value(_update_slice(stacked, index, sharding.put(value, slice_sharding)))


def checkpoint_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files (a sharded one's from its index), each inside
    `model_dir`; ValueError naming the index or directory otherwise."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        index_json = read_json(index, index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must be a JSON object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if os.path.isabs(f) or ".." in f.replace("\\", "/").split("/")]
        if outside:
            raise ValueError(f"{index}: weight_map names {outside[0][:80]!r}, not a file inside the checkpoint")
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return [os.path.join(model_dir, f) for f in files]


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yield the checkpoint's tensors one by one (sharded checkpoints via their index). Every
    file's header is checked against the file (jpaged/file_safety.py) before any tensor is read:
    a truncated file, a malformed header or overlapping tensors are a ValueError naming the file."""
    headers = [(path, safetensors_header(path, path)) for path in checkpoint_files(model_dir)]
    for path, header in headers:
        for name, entry in header.items():
            if name != "__metadata__" and entry["dtype"] not in ST_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which jpaged does not read")
    for path, header in headers:
        yield from _read_tensors(path, header)


# safetensors' dtypes as numpy (ml_dtypes for the 8- and 16-bit floats numpy lacks), little-endian.
ST_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": "<i2", "U16": "<u2", "I32": "<i4",
             "U32": "<u4", "I64": "<i8", "U64": "<u8", "F16": "<f2", "F32": "<f4", "F64": "<f8",
             "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _read_tensors(path: str, header: dict) -> Iterator[tuple[str, np.ndarray]]:
    """`path`'s tensors, by name, read at the offsets of its checked `header` into fresh arrays
    (no mapping of the file: one that shrinks while we read is a ValueError, not a crash)."""
    with open_regular(path, path) as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
        for name in sorted(n for n in header if n != "__metadata__"):
            entry = header[name]
            begin, end = entry["data_offsets"]
            array = np.empty(end - begin, np.uint8)
            f.seek(data_start + begin)
            if f.readinto(memoryview(array)) != end - begin:
                raise ValueError(f"{path}: truncated while reading tensor {name!r}")
            yield name, array.view(np.dtype(ST_DTYPES[entry["dtype"]])).reshape(entry["shape"])


# Files transformers or jpaged may open in a checkpoint directory (config, weights, tokenizer).
CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken", ".py")


def check_regular_files(model_dir: str):
    """Every file of the checkpoint that may be read is a regular file (a FIFO would block start-up,
    a link to a device such as /dev/zero never end): ValueError naming it otherwise."""
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name.endswith(CHECKPOINT_SUFFIXES) and not os.path.isdir(path):
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):
                    raise ValueError(f"{path}: not a regular file")
            except OSError as e:
                raise ValueError(f"{path}: cannot be read ({e.strerror})") from None


def read_hf_config(model_dir: str, overrides: dict | None = None) -> "PretrainedConfig":
    """config.json read safely (a bounded regular file, JSON of bounded depth) and its fields that
    jpaged reads type-checked before transformers parses it; ValueError naming the file otherwise.
    `overrides` (vLLM's hf_overrides): fields set on the config after reading."""
    config = _read_hf_config(model_dir)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    return config


def _read_hf_config(model_dir: str) -> "PretrainedConfig":
    path = os.path.join(model_dir, "config.json")
    raw = read_json(path, path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    qc = raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"{path}: quantization_config must be a JSON object, got {type(qc).__name__}")
    for field in ("architectures",):
        if field in raw and not (isinstance(raw[field], list) and all(isinstance(a, str) for a in raw[field])):
            raise ValueError(f"{path}: {field} must be a list of strings")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        raise ValueError(f"{path}: transformers cannot read it ({type(e).__name__}: {one_line(e)})") from None


def one_line(e: BaseException, limit: int = 200) -> str:
    return " ".join(str(e).split())[:limit]


def resolve_model_dir(model: str, revision: str | None = None) -> str:
    if os.path.isdir(model):
        return model
    if os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model):
        raise ValueError(f"model {model!r} is not a directory with a Hugging Face checkpoint")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, no access
        raise ValueError(f"model {model!r} is neither a local directory nor a reachable Hugging Face hub id: {e}") from e


def load_model_of(config) -> LoadedModel:
    """The model an EngineConfig names, as it asks (the engine's start, and a wake-up that reads it again)."""
    return load_model(config.model, dtype=config.dtype, attention_backend=config.attention_backend,
                      revision=config.revision, tensor_parallel_size=config.tensor_parallel_size,
                      max_model_len=config.max_model_len, quantization=config.quantization, devices=config.devices,
                      batch_invariant=config.batch_invariant, hf_overrides=config.hf_overrides)


def load_model(model: str, *, dtype="auto", attention_backend: str = "auto", revision: str | None = None,
               tensor_parallel_size: int = 1, max_model_len: int | None = None,
               quantization: str | None = None, devices: list | None = None,
               batch_invariant: bool = False, hf_overrides: dict | None = None) -> LoadedModel:
    """`quantization`: None (what the checkpoint's quantization_config says, if anything), "fp8" or
    "int8" (quantize a float checkpoint while loading), or the checkpoint's own method name.
    `devices`: the mesh's (default: the first tensor_parallel_size)."""
    mesh = sharding.make_mesh(tensor_parallel_size, devices)  # fails on too few devices before reading anything
    if model == "tiny":
        from jpaged.models import tiny
        hf_config = tiny.tiny_engine_config()
        for name, value in (hf_overrides or {}).items():
            setattr(hf_config, name, value)
        jdtype = resolve_dtype(dtype, hf_config)
        weights, tokenizer = tiny.tiny_weights(hf_config), tiny.tiny_tokenizer()
    else:
        model_dir = resolve_model_dir(model, revision)
        check_regular_files(model_dir)
        hf_config = read_hf_config(model_dir, hf_overrides)
        if adapt := getattr(get_model_class(hf_config), "adapt_hf_config", None):  # (unsupported: fails here)
            adapt(hf_config)  # a multimodal config's text fields read at its top level
        jdtype = resolve_dtype(dtype, hf_config)
        weights = iter_safetensors(model_dir)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError, TypeError):
            logger.warning("no tokenizer found in %s: prompts must be token ids", model_dir)
            tokenizer = None
        except Exception as e:  # e.g. a corrupt tokenizer.json (the tokenizers library's own exception)
            raise ValueError(f"{model_dir}: the tokenizer cannot be read ({type(e).__name__}: {one_line(e)})") \
                from None
    model_cls = get_model_class(hf_config)
    processor = load_processor(model_dir, model_cls) if getattr(model_cls, "is_multimodal", False) else None
    quant = quantization_of(hf_config, quantization)
    found = {}
    nn_model = build_model(hf_config, weights, dtype=jdtype, attention_backend=attention_backend, mesh=mesh,
                           max_model_len=max_model_len, kv_scales=found, quantization=quant,
                           batch_invariant=batch_invariant)
    return LoadedModel(nn_model, hf_config, tokenizer, jdtype, mesh, kv_scales_of(found), quant,
                       model_memory_bytes(nn_model), processor)


def load_processor(model_dir: str, model_cls):
    """The checkpoint's processor: the model class's `load_processor` if it has one, else its
    AutoProcessor (None, with a warning, when it cannot be read: images are refused then)."""
    from transformers import AutoProcessor

    try:
        return getattr(model_cls, "load_processor", AutoProcessor.from_pretrained)(model_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds (AttributeError without torchvision)
        logger.warning("no image processor in %s (%s): requests with images are refused", model_dir, one_line(e))
        return None
