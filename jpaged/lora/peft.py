"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`, or the older
`adapter_model.bin`-free layouts that PEFT writes today), read and checked.

Supported: LoRA on the attention (q/k/v/o) and MLP (gate/up/down) projections, any rank up to
max_lora_rank, `lora_alpha` scaling (alpha / r, or alpha / sqrt(r) with `use_rslora`). Anything
else PEFT can express (DoRA, biases, modules_to_save, embeddings or the LM head, per-module ranks
or alphas, fan_in_fan_out layouts) is a ValueError naming the field: its output would not be
the adapter's.
"""

import dataclasses
import json
import math
import os
import re

import numpy as np

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


@dataclasses.dataclass
class PeftAdapter:
    """One adapter: `weights[hf_module_name] = (A [r, in], B [out, r] with the scaling folded in)`."""

    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def resolve_adapter_dir(path: str) -> str:
    """A local directory, or a hub id downloaded (or found in the local hub cache)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"lora_path={path!r} is a file; expected a directory with adapter_config.json")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["adapter_config.json", "*.safetensors"])
    except Exception as e:  # not a hub id, or no network: the path is what the user got wrong
        raise ValueError(f"lora_path={path!r} is not a directory, and not a hub id that could be downloaded "
                         f"({type(e).__name__})") from None


def load_peft_adapter(path: str, max_lora_rank: int) -> PeftAdapter:
    """The adapter at `path` (directory or hub id), ValueError naming what is wrong with it."""
    directory = resolve_adapter_dir(path)
    config_path = os.path.join(directory, "adapter_config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"lora_path={path!r} has no adapter_config.json (not a PEFT adapter)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"lora_path={path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path={path!r}: adapter_config.json is not a JSON object")

    def field(name, default=None):
        return config.get(name, default)

    def refuse(name, why):
        raise ValueError(f"lora_path={path!r}: adapter_config.json {name}={field(name)!r}: {why}")

    if field("peft_type", "LORA") != "LORA":
        refuse("peft_type", "only LORA adapters are supported")
    rank = field("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        refuse("r", "expected an integer >= 1")
    if rank > max_lora_rank:
        refuse("r", f"the rank exceeds max_lora_rank={max_lora_rank}")
    alpha = field("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        refuse("lora_alpha", "expected a number")
    for name, ok in (("use_dora", not field("use_dora")), ("bias", field("bias", "none") == "none"),
                     ("modules_to_save", not field("modules_to_save")),
                     ("fan_in_fan_out", not field("fan_in_fan_out")),
                     ("rank_pattern", not field("rank_pattern")), ("alpha_pattern", not field("alpha_pattern")),
                     ("layers_to_transform", field("layers_to_transform") is None)):
        if not ok:
            refuse(name, "not supported")
    scale = alpha / math.sqrt(rank) if field("use_rslora") else alpha / rank
    tensors = _read_tensors(directory, path)
    weights, parts = {}, {}
    for key, value in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise ValueError(f"lora_path={path!r}: tensor {key!r} is not a LoRA A or B weight this engine applies")
        parts.setdefault(match["module"], {})[match["ab"]] = value
    for module, ab in parts.items():
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_MODULES:
            raise ValueError(f"lora_path={path!r}: LoRA on {module!r}; supported modules: {', '.join(SUPPORTED_MODULES)}")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path={path!r}: {module!r} has lora_{'A' if 'B' in ab else 'B'} missing")
        a, b = ab["A"].astype(np.float32), ab["B"].astype(np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"lora_path={path!r}: {module!r} has lora_A {a.shape} and lora_B {b.shape}; "
                             f"expected [r, in] and [out, r] with r={rank}")
        weights[module] = (a, b * np.float32(scale))
    if not weights:
        raise ValueError(f"lora_path={path!r}: the adapter has no LoRA weights")
    return PeftAdapter(path, rank, weights)


def _read_tensors(directory: str, path: str) -> dict[str, np.ndarray]:
    import safetensors.numpy

    file = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise ValueError(f"lora_path={path!r} has no adapter_model.safetensors")
    try:
        return safetensors.numpy.load_file(file)
    except Exception as e:  # truncated or not safetensors at all
        raise ValueError(f"lora_path={path!r}: adapter_model.safetensors cannot be read ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None
