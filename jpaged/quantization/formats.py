"""Which Linear layers a checkpoint (or `quantization=`) quantizes, and how: its quantization_config
read into WeightSchemes, and readers that turn each quantized module's tensors into one
QuantizedTensor (scheme.py) in [out, in] layout, named `<module>.weight` as a float weight is.

- on the fly ("fp8", "int8"): a bf16/fp16/fp32 checkpoint; every Linear but the LM head,
  per output channel (vLLM's fp8 and int8 W8A16 schemes).
- compressed-tensors (llm-compressor's output): float-quantized (fp8 per tensor or channel),
  int-quantized / naive-quantized (int8), pack-quantized (int4 or int8 packed in int32, groups,
  zero points packed along the output axis).
- AWQ (GEMM packing) and GPTQ (v1 and v2 zero points) int4, in groups.
"""

import dataclasses
import re
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from jpaged.config import QUANTIZATION_METHODS
from jpaged.quantization.scheme import QuantizedTensor, WeightScheme

ON_THE_FLY = {"fp8": WeightScheme("float8_e4m3fn"), "int8": WeightScheme("int8")}


@dataclasses.dataclass
class Quantization:
    """method: a name from QUANTIZATION_METHODS; `schemes` [(pattern, scheme)]: the first whose
    pattern matches a module's name quantizes it; `ignore`: patterns of modules left alone."""

    method: str
    schemes: list
    ignore: tuple = ()
    config: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        schemes = "; ".join(dict.fromkeys(scheme.describe() for _, scheme in self.schemes))
        return f"{self.method} ({schemes})"

    def scheme_for(self, module: str) -> WeightScheme | None:
        if any(_matches(p, module) for p in self.ignore):
            return None
        if self.method in ON_THE_FLY and module.rsplit(".", 1)[-1] == "lm_head":
            return None  # the LM head stays in the activation dtype, as vLLM keeps it
        return next((s for patterns, s in self.schemes if any(_matches(p, module) for p in patterns)), None)

    def read(self, tensors: Iterable[tuple[str, np.ndarray]], quantized: dict[str, WeightScheme]) -> Iterator:
        """The checkpoint's tensors with each module of `quantized` ({module name: scheme})
        assembled into one (`<module>.weight`, QuantizedTensor); the rest pass through."""
        if self.method in ON_THE_FLY:
            yield from tensors
            return
        reader, parts = READERS[self.method], {}
        for name, tensor in tensors:
            module, _, leaf = name.rpartition(".")
            if leaf not in reader.leaves:
                yield name, tensor
                continue
            if module not in quantized:
                if leaf == "weight":
                    yield name, tensor
                    continue
                raise ValueError(f"the checkpoint quantizes {module!r} ({name}), which jpaged keeps in full "
                                 "precision: it quantizes only dense Linear layers")
            parts.setdefault(module, {})[leaf] = tensor
            if reader.complete(parts[module], quantized[module]):
                yield f"{module}.weight", _read_module(reader, module, parts.pop(module), quantized[module],
                                                       self.config)
        if parts:
            module, found = next(iter(parts.items()))
            raise ValueError(f"the checkpoint's quantized {module!r} is incomplete: it has only {sorted(found)}")


def _read_module(reader, module: str, found: dict, scheme: WeightScheme, config: dict) -> QuantizedTensor:
    """One module's tensors read into a QuantizedTensor; a malformed one (wrong dtypes or shapes)
    is a ValueError naming the module, never a numpy error without context."""
    scale_name = f"{module}.{reader.scale_leaf}"
    for leaf, tensor in found.items():
        dtype = np.asarray(tensor).dtype
        floating = np.issubdtype(dtype, np.floating) or dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)
        if leaf == reader.scale_leaf and not floating:
            raise ValueError(f"tensor {scale_name!r} has dtype {dtype}; scales are floating point")
        if leaf in reader.integer_leaves and not np.issubdtype(dtype, np.integer):
            raise ValueError(f"tensor {module}.{leaf!s} has dtype {dtype}; expected integers")
    try:
        qt = reader.read(module, found, scheme, config)
    except (ValueError, IndexError, TypeError) as e:
        message = str(e)
        raise ValueError(message if module in message else f"the checkpoint's quantized {module!r}: {message}") \
            from None
    qt.scale_name = scale_name
    return qt


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target / ignore matching: "re:<regex>" from the start of the name, a
    module's full name, or a class name ("Linear": every Linear layer)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern in ("Linear", module)


def quantization_of(hf_config, quantization: str | None) -> Quantization | None:
    """The checkpoint's quantization (config.json's quantization_config), or `quantization` for
    on-the-fly; ValueError naming the format for anything jpaged cannot read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        if not hasattr(qc, "to_dict"):  # transformers' own config classes have one
            raise ValueError(f"the checkpoint's quantization_config must be a JSON object, got {type(qc).__name__}")
        qc = qc.to_dict()
    found = None
    if qc:
        method = qc.get("quant_method")
        try:
            if method == "compressed-tensors":
                found = _compressed_tensors(qc)
            elif method in ("awq", "gptq"):
                found = _awq_gptq(method, qc)
            else:
                raise ValueError(f"the checkpoint's quantization_config has quant_method={str(method)[:40]!r}; "
                                 "jpaged reads 'compressed-tensors', 'awq' (GEMM) and 'gptq' checkpoints")
        except (TypeError, AttributeError, KeyError) as e:  # a field of another type than the format's
            raise ValueError(f"the checkpoint's quantization_config is malformed ({type(e).__name__}: "
                             f"{str(e)[:120]})") from None
    if quantization is None:
        return found
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={quantization!r}; expected None or one of {QUANTIZATION_METHODS}")
    if found is not None:
        if quantization != found.method:
            raise ValueError(f"quantization={quantization!r}, but the checkpoint is already quantized "
                             f"({found.method}); leave quantization unset to load it")
        return found
    if quantization not in ON_THE_FLY:
        raise ValueError(f"quantization={quantization!r}: the checkpoint has no quantization_config of that format")
    return Quantization(quantization, [(("Linear",), ON_THE_FLY[quantization])])


# ----------------------------------------------------------------------------- compressed-tensors

def _ct_scheme(group: dict, where: str) -> WeightScheme:
    w = group.get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if kind == "float" and bits == 8:
        qtype = "float8_e4m3fn"
    elif kind == "int" and bits in (4, 8):
        qtype = f"int{bits}"
    else:
        raise ValueError(f"compressed-tensors {where}: weights of type={kind!r} num_bits={bits!r}; jpaged reads "
                         "8-bit float and 8- or 4-bit int weights")
    if strategy not in ("tensor", "channel", "group"):
        raise ValueError(f"compressed-tensors {where}: weight strategy {strategy!r}; jpaged reads 'tensor', "
                         "'channel' and 'group'")
    size = w.get("group_size")
    if strategy == "group" and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ValueError(f"compressed-tensors {where}: strategy 'group' needs an integer group_size >= 1, "
                         f"got {str(size)[:20]!r}")
    if kind == "float" and not w.get("symmetric", True):
        raise ValueError(f"compressed-tensors {where}: asymmetric fp8 weights are not supported")
    activations = None
    if act := group.get("input_activations"):
        kind, bits, strategy = act.get("type"), act.get("num_bits"), act.get("strategy")
        if bits != 8 or kind not in ("float", "int") or not act.get("symmetric", True) or not act.get("dynamic") \
                or strategy not in ("token", "tensor"):
            raise ValueError(f"compressed-tensors {where}: input activations of type={kind!r} num_bits={bits!r} "
                             f"strategy={strategy!r} dynamic={act.get('dynamic')!r}; jpaged reads symmetric dynamic "
                             "8-bit per-token activations (static activation scales are not supported)")
        activations = "float8_e4m3fn" if kind == "float" else "int8"
    return WeightScheme(qtype, w.get("group_size") if strategy == "group" else None,
                        zero_point=not w.get("symmetric", True), activations=activations)


def _field(value, kind, where: str, default=None):
    """`value` if it is a `kind` (None: `default`); ValueError naming quantization_config's field otherwise."""
    if value is None:
        return default
    ok = (isinstance(value, list) and all(isinstance(x, str) for x in value)) if kind == "strings" else \
        (isinstance(value, int) and not isinstance(value, bool)) if kind is int else isinstance(value, kind)
    if not ok:
        expected = {"strings": "a list of strings", dict: "a JSON object", int: "an integer", bool: "a boolean",
                    str: "a string"}[kind]
        raise ValueError(f"the checkpoint's quantization_config.{where} must be {expected}, got "
                         f"{type(value).__name__}")
    return value


def _compressed_tensors(qc: dict) -> Quantization | None:
    groups = _field(qc.get("config_groups"), dict, "config_groups", {})
    schemes = []
    for key, group in groups.items():
        _field(group, dict, f"config_groups.{key}")
        for part in ("weights", "input_activations"):
            _field(group.get(part), dict, f"config_groups.{key}.{part}")
        _field(group.get("targets"), "strings", f"config_groups.{key}.targets")
        if not group.get("weights"):
            continue  # activation- or KV-only groups leave the weights alone
        fmt = group.get("format") or qc.get("format")
        if fmt not in CompressedTensors.FORMATS:
            raise ValueError(f"compressed-tensors config group {key!r} has format {fmt!r}; jpaged reads "
                             f"{', '.join(CompressedTensors.FORMATS)}")
        schemes.append((tuple(group.get("targets") or ()), _ct_scheme(group, f"config group {key!r}")))
    if qc.get("sparsity_config"):
        raise ValueError("compressed-tensors sparse checkpoints (sparsity_config) are not supported")
    if not schemes:
        return None  # e.g. an fp8 KV cache scheme only (read by the loader as KV scales)
    return Quantization("compressed-tensors", schemes, tuple(_field(qc.get("ignore"), "strings", "ignore", ())), qc)


class CompressedTensors:
    FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
    leaves = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
              "input_scale", "input_zero_point", "weight_global_scale")
    scale_leaf = "weight_scale"
    integer_leaves = ("weight_packed", "weight_zero_point", "weight_shape", "weight_g_idx")

    @staticmethod
    def complete(found: dict, scheme: WeightScheme) -> bool:
        data = "weight" in found or ("weight_packed" in found and "weight_shape" in found)
        return data and "weight_scale" in found and (not scheme.zero_point or "weight_zero_point" in found)

    @staticmethod
    def read(module: str, found: dict, scheme: WeightScheme, config: dict) -> QuantizedTensor:
        bits = 4 if scheme.qtype == "int4" else 8
        if "weight_packed" in found:
            out, n_in = (int(d) for d in np.asarray(found["weight_shape"]).reshape(-1))
            values = unpack_int32(np.asarray(found["weight_packed"]), bits, n_in) - (1 << (bits - 1))
        else:
            values = np.asarray(found["weight"])
            out, n_in = values.shape
        if scheme.qtype == "float8_e4m3fn":
            values = values.view(ml_dtypes.float8_e4m3fn) if values.dtype.itemsize == 1 else values
            if values.dtype != ml_dtypes.float8_e4m3fn:
                raise ValueError(f"{module}.weight: expected float8_e4m3fn values, found {values.dtype}")
        else:
            values = values.astype(np.int8)
        scale = np.asarray(found["weight_scale"], np.float32)
        scale = scale.reshape(1, 1) if scale.size == 1 else scale.reshape(out, -1)
        scale = np.broadcast_to(scale, (out, scale.shape[1])).copy()
        groups = scale.shape[1]
        if n_in % groups or (scheme.group_size and groups != n_in // scheme.group_size):
            raise ValueError(f"{module}.weight_scale has {groups} groups for {n_in} columns")
        _check_g_idx(module, found.get("weight_g_idx"), n_in // groups)
        zero = None
        if scheme.zero_point:
            zp = np.asarray(found["weight_zero_point"])
            if zp.dtype == np.int32 and bits < 8 and zp.shape[0] != out:  # packed along the output axis
                zp = unpack_int32(zp.T, bits, out).T - (1 << (bits - 1))
            zero = zp.reshape(out, groups).astype(np.int8)
        return QuantizedTensor(values.reshape(out, n_in), scale, zero)


def unpack_int32(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Values of `bits` bits packed densely, lowest bits first, along the last axis of int32
    words (compressed-tensors' and GPTQ's order): the first `n` per row, unsigned, as int32."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(0, 32, bits, dtype=np.int64)
    values = (words[..., :, None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[:-1] + (-1,))[..., :n].astype(np.int32)


def _check_g_idx(module: str, g_idx, group_size: int):
    """Activation order (GPTQ's desc_act) stores columns' groups out of order: jpaged's groups are
    consecutive columns, so only the trivial order is read."""
    if g_idx is None:
        return
    g_idx = np.asarray(g_idx).reshape(-1)
    if not np.array_equal(g_idx, np.arange(g_idx.size) // group_size):
        raise ValueError(f"{module}: activation-ordered groups (g_idx, GPTQ desc_act) are not supported")


# ----------------------------------------------------------------------------- AWQ, GPTQ

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def _awq_gptq(method: str, qc: dict) -> Quantization:
    bits, group_size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    _field(group_size, int, "group_size")
    _field(qc.get("modules_to_not_convert"), "strings", "modules_to_not_convert")
    for block in _field(qc.get("modules_in_block_to_quantize"), list, "modules_in_block_to_quantize", []):
        _field(block, "strings", "modules_in_block_to_quantize[i]")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise ValueError(f"AWQ version={version!r} bits={bits!r}: jpaged reads 4-bit GEMM-packed AWQ")
        scheme = WeightScheme("int4", group_size if group_size and group_size > 0 else None, zero_point=True)
    else:
        if bits not in (4, 8):
            raise ValueError(f"GPTQ bits={bits!r}: jpaged reads 4- and 8-bit GPTQ")
        if qc.get("desc_act") and group_size not in (None, -1):
            raise ValueError("GPTQ desc_act=true (activation-ordered groups) is not supported")
        scheme = WeightScheme(f"int{bits}", group_size if group_size and group_size > 0 else None,
                              zero_point=not qc.get("sym", True))
    ignore = tuple(f"re:.*{re.escape(m)}" for m in qc.get("modules_to_not_convert") or ())  # vLLM: a substring
    targets = ("Linear",)
    if blocks := qc.get("modules_in_block_to_quantize"):  # GPTQ: only these, by their names in a layer
        targets = tuple(f"re:.*\\.{re.escape(m)}$" for block in blocks for m in block)
    return Quantization(method, [(targets, scheme)], ignore + ("lm_head",), qc)


class AWQ:
    leaves = ("qweight", "qzeros", "scales")
    scale_leaf = "scales"
    integer_leaves = ("qweight", "qzeros")

    @staticmethod
    def complete(found: dict, scheme) -> bool:
        return all(leaf in found for leaf in AWQ.leaves)

    @staticmethod
    def read(module: str, found: dict, scheme: WeightScheme, config: dict) -> QuantizedTensor:
        """qweight [in, out/8] and qzeros [groups, out/8] int32, 8 columns per word in the order
        0 2 4 6 1 3 5 7; scales [groups, out]. W = (q - zero) * scale."""
        def unpack(packed):
            nibbles = unpack_int32(packed, 4, packed.shape[-1] * 8)
            rows = nibbles.reshape(packed.shape[0], -1, 8)
            return rows[:, :, np.argsort(AWQ_ORDER)].reshape(packed.shape[0], -1)
        q, zeros, scale = unpack(np.asarray(found["qweight"])), unpack(np.asarray(found["qzeros"])), found["scales"]
        scale = np.asarray(scale, np.float32)
        n_in = q.shape[0]
        _check_groups(module, n_in, scale.shape[0], scheme)
        return QuantizedTensor((q - 8).T.astype(np.int8), scale.T.copy(), (zeros - 8).T.astype(np.int8))


class GPTQ:
    leaves = ("qweight", "qzeros", "scales", "g_idx")
    scale_leaf = "scales"
    integer_leaves = ("qweight", "qzeros", "g_idx")

    @staticmethod
    def complete(found: dict, scheme) -> bool:
        return all(leaf in found for leaf in ("qweight", "qzeros", "scales"))

    @staticmethod
    def read(module: str, found: dict, scheme: WeightScheme, config: dict) -> QuantizedTensor:
        """qweight [in/(32/bits), out] packed along the input, qzeros [groups, out/(32/bits)]
        packed along the output, both lowest bits first; scales [groups, out]. GPTQ v1 stores
        zero - 1 (checkpoint_format "gptq"), v2 the zero itself."""
        bits = 4 if scheme.qtype == "int4" else 8
        qweight = np.asarray(found["qweight"])
        n_in = qweight.shape[0] * 32 // bits
        q = unpack_int32(qweight.T, bits, n_in).T  # [in, out]
        scale = np.asarray(found["scales"], np.float32)
        out = scale.shape[1]
        zeros = unpack_int32(np.asarray(found["qzeros"]), bits, out)
        if config.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = (zeros + 1) & ((1 << bits) - 1)
        _check_groups(module, n_in, scale.shape[0], scheme)
        _check_g_idx(module, found.get("g_idx"), n_in // scale.shape[0])
        offset = 1 << (bits - 1)
        if not scheme.zero_point and not np.all(zeros == offset):
            raise ValueError(f"{module}: sym=true GPTQ checkpoint has zero points other than {offset}")
        return QuantizedTensor((q - offset).T.astype(np.int8), scale.T.copy(),
                               (zeros - offset).T.astype(np.int8) if scheme.zero_point else None)


def _check_groups(module: str, n_in: int, groups: int, scheme: WeightScheme):
    expected = 1 if scheme.group_size is None else n_in // scheme.group_size
    if groups != expected:
        raise ValueError(f"{module}: scales have {groups} groups; {n_in} columns in groups of "
                         f"{scheme.group_size} make {expected}")


READERS = {"compressed-tensors": CompressedTensors, "awq": AWQ, "gptq": GPTQ}
