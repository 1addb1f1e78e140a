"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`), read and checked.

Supported: LoRA on the attention (q/k/v/o) and MLP (gate/up/down) projections, any rank up to
max_lora_rank, `lora_alpha` scaling (alpha / r, or alpha / sqrt(r) with `use_rslora`). Anything
else PEFT can express (DoRA, biases, modules_to_save, embeddings or the LM head, per-module ranks
or alphas, fan_in_fan_out layouts) is a ValueError naming the field: its output would not be
the adapter's.

The files are read as jpaged/file_safety.py reads what users name: regular files only, opened
without blocking, sizes bounded before reading, JSON depth bounded, the safetensors header checked
against the file before a tensor is read. What cannot be opened or read at all (missing, a
directory, no permission, a FIFO or device, too large, outside the allowed directories) is an
`AdapterUnreadable`, so that a server can answer it with one message that tells nothing about
what exists on disk; what was read but is wrong is a ValueError naming the field or tensor.
Values are checked too: floating tensors only, finite, and |x| <= MAX_ABS_VALUE after the scaling
is folded into B (a trained adapter's entries are far below 1: PEFT starts A at about
1/sqrt(in) and B at 0; 1e4 leaves four orders of margin, while NaN, Inf or 1e38 would make every
logit NaN or -inf and every answer empty).
"""

import dataclasses
import math
import os
import re

import ml_dtypes
import numpy as np

from jpaged import file_safety

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
MAX_CONFIG_BYTES = 4 << 20  # adapter_config.json is a few hundred bytes
# adapter_model.safetensors' header: ~150 bytes a tensor, two tensors per module and layer (an
# adapter on all 7 modules of 126 layers: ~260 KB). 16 MiB, not safetensors' 100 MiB: a header that
# large is no adapter, and it is checked and parsed in at most ~3 x its size (file_safety).
MAX_HEADER_BYTES = 16 << 20
MAX_ABS_VALUE = 1e4  # largest |entry| of A and of B x scaling (see above)
MAX_LORA_ALPHA = 1e5  # alphas in use are at most a few hundred (often 2 x r)
FLOAT_DTYPES = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64}
_FIELD_TYPES = {  # adapter_config.json fields whose type is checked (None is always allowed)
    "peft_type": str, "bias": str, "task_type": str, "base_model_name_or_path": str, "use_rslora": bool,
    "use_dora": bool, "fan_in_fan_out": bool, "inference_mode": bool, "rank_pattern": dict,
    "alpha_pattern": dict, "modules_to_save": list, "lora_dropout": (int, float),
}


class AdapterUnreadable(ValueError):
    """The adapter's directory or files could not be opened or read (the message says why, for
    logs and offline users; a server answers with `public_message` instead)."""

    def public_message(self, path: str) -> str:
        return f"lora_path {path!r} is not a loadable adapter (not a readable PEFT adapter directory)"


@dataclasses.dataclass
class PeftAdapter:
    """One adapter: `weights[hf_module_name] = (A [r, in], B [out, r] with the scaling folded in)`."""

    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _is_under(path: str, directories) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, os.path.realpath(d)]) == os.path.realpath(d) for d in directories)


def resolve_adapter_dir(path: str, *, download: bool = True, allowed_dirs=None) -> str:
    """A local directory, or (with `download`) a hub id downloaded (or found in the local hub
    cache); with `allowed_dirs`, only a directory whose real path is under one of them."""
    if allowed_dirs is not None and not _is_under(path, allowed_dirs):
        raise AdapterUnreadable(f"lora_path={path!r} is not under the allowed directories (--allowed-lora-paths)")
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise AdapterUnreadable(f"lora_path={path!r} is a file; expected a directory with adapter_config.json")
    if not download:
        raise AdapterUnreadable(f"lora_path={path!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["adapter_config.json", "*.safetensors"])
    except Exception as e:  # not a hub id, or no network: the path is what the user got wrong
        raise AdapterUnreadable(f"lora_path={path!r} is not a directory, and not a hub id that could be downloaded "
                                f"({type(e).__name__})") from None


def _open(file: str, what: str, allowed_dirs, max_bytes=None):
    if allowed_dirs is not None and not _is_under(file, allowed_dirs):
        raise AdapterUnreadable(f"{what}: links outside the allowed directories (--allowed-lora-paths)")
    try:
        return file_safety.open_regular(file, what, max_bytes)
    except ValueError as e:  # missing, no permission, not a regular file, too large
        raise AdapterUnreadable(str(e)) from None


def read_adapter_config(directory: str, path: str, allowed_dirs=None) -> dict:
    what = f"lora_path={path!r}: adapter_config.json"
    with _open(os.path.join(directory, "adapter_config.json"), what, allowed_dirs, MAX_CONFIG_BYTES) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterUnreadable(f"{what}: more than the {MAX_CONFIG_BYTES} bytes allowed")
    config = file_safety.loads_json(data, what)
    if not isinstance(config, dict):
        raise ValueError(f"{what} is not a JSON object")
    return config


def load_peft_adapter(path: str, max_lora_rank: int, *, download: bool = True, allowed_dirs=None) -> PeftAdapter:
    """The adapter at `path` (directory, or hub id with `download`), ValueError naming what is
    wrong with it (AdapterUnreadable: nothing could be read)."""
    directory = resolve_adapter_dir(path, download=download, allowed_dirs=allowed_dirs)
    config = read_adapter_config(directory, path, allowed_dirs)

    def field(name, default=None):
        return config.get(name, default)

    def refuse(name, why):
        raise ValueError(f"lora_path={path!r}: adapter_config.json {name}={repr(field(name))[:100]}: {why}")

    for name, kind in _FIELD_TYPES.items():
        value = field(name)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            names = kind.__name__ if isinstance(kind, type) else "number"
            refuse(name, f"expected a {names}")
    if field("peft_type", "LORA") != "LORA":
        refuse("peft_type", "only LORA adapters are supported")
    rank = field("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        refuse("r", "expected an integer >= 1")
    if rank > max_lora_rank:
        refuse("r", f"the rank exceeds max_lora_rank={max_lora_rank}")
    alpha = field("lora_alpha", 8)
    if (not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha)
            or not 0 < alpha <= MAX_LORA_ALPHA):
        refuse("lora_alpha", f"expected a number in (0, {MAX_LORA_ALPHA:g}]")
    targets = field("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        refuse("target_modules", "expected a string or a list of strings")
    layers = field("layers_to_transform")
    for name, ok in (("use_dora", not field("use_dora")), ("bias", field("bias", "none") == "none"),
                     ("modules_to_save", not field("modules_to_save")),
                     ("fan_in_fan_out", not field("fan_in_fan_out")),
                     ("rank_pattern", not field("rank_pattern")), ("alpha_pattern", not field("alpha_pattern")),
                     ("layers_to_transform", layers is None)):
        if not ok:
            refuse(name, "not supported")
    scale = alpha / math.sqrt(rank) if field("use_rslora") else alpha / rank
    tensors = _read_tensors(directory, path, rank, allowed_dirs)
    weights, parts = {}, {}
    for key, value in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise ValueError(f"lora_path={path!r}: tensor {key!r} is not a LoRA A or B weight this engine applies")
        parts.setdefault(match["module"], {})[match["ab"]] = (key, value)
    for module, ab in parts.items():
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_MODULES:
            raise ValueError(f"lora_path={path!r}: LoRA on {module!r}; supported modules: "
                             f"{', '.join(SUPPORTED_MODULES)}")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path={path!r}: {module!r} has lora_{'A' if 'B' in ab else 'B'} missing")
        (a_name, a), (b_name, b) = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"lora_path={path!r}: {module!r} has lora_A {a.shape} and lora_B {b.shape}; "
                             f"expected [r, in] and [out, r] with r={rank}")
        with np.errstate(over="ignore", invalid="ignore"):
            a, b = a.astype(np.float32), b.astype(np.float32) * np.float32(scale)
        for name, value in ((a_name, a), (b_name, b)):
            _check_values(value, f"lora_path={path!r}: tensor {name!r}" + (f" (x scaling {scale:g})" if value is b
                                                                            else ""))
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"lora_path={path!r}: the adapter has no LoRA weights")
    return PeftAdapter(path, rank, weights)


def _check_values(value: np.ndarray, what: str):
    if not np.isfinite(value).all():
        raise ValueError(f"{what} has NaN or infinite values")
    largest = float(np.abs(value).max(initial=0))
    if largest > MAX_ABS_VALUE:
        raise ValueError(f"{what} has a value of magnitude {largest:.3g}, more than the {MAX_ABS_VALUE:g} allowed")


def _read_tensors(directory: str, path: str, rank: int, allowed_dirs=None) -> dict[str, np.ndarray]:
    """The safetensors file's tensors, after its header was checked against the file: floating
    dtypes only, 2-D with the rank on the right side (so a header cannot make us read more than a
    rank-r adapter's worth), then exactly the bytes the tensors span."""
    what = f"lora_path={path!r}: adapter_model.safetensors"
    file = os.path.join(directory, "adapter_model.safetensors")
    _open(file, what, allowed_dirs).close()  # missing, a FIFO, a device: unreadable, before the header is read
    try:
        header = file_safety.safetensors_header(file, what, MAX_HEADER_BYTES)
    except ValueError as e:
        raise ValueError(f"{e} (cannot be read)") from None
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in entries.items():
        if entry["dtype"] not in FLOAT_DTYPES:
            raise ValueError(f"{what}: tensor {name!r} has dtype {entry['dtype']}; expected a floating dtype "
                             f"({', '.join(FLOAT_DTYPES)})")
        match, shape = _TENSOR.match(name), entry["shape"]
        if match is None:
            raise ValueError(f"lora_path={path!r}: tensor {name!r} is not a LoRA A or B weight this engine applies")
        side = 0 if match["ab"] == "A" else 1
        if len(shape) != 2 or shape[side] != rank:
            raise ValueError(f"{what}: tensor {name!r} has shape {shape[:4]}; expected 2 dimensions with r={rank} "
                             f"as its {'first' if side == 0 else 'second'}")
    with _open(file, what, allowed_dirs) as f:
        length = int.from_bytes(f.read(8), "little")
        f.seek(8 + length)
        end = max((entry["data_offsets"][1] for entry in entries.values()), default=0)
        data = f.read(end)
    if len(data) < end:  # shrank since the header was checked
        raise ValueError(f"{what}: truncated while read (cannot be read)")
    tensors = {}
    for name, entry in entries.items():
        begin, stop = entry["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:stop], FLOAT_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors
