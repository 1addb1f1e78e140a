"""How a checkpoint's hidden states become one vector per input (vLLM's PoolerConfig): read from
the files sentence-transformers writes (modules.json, 1_Pooling/config.json, a Normalize module),
else the model type's default (CLS for encoders, the last token for decoders)."""

import dataclasses
import os

from jpaged.file_safety import read_json

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# sentence-transformers' pooling modes -> vLLM's pooling types (older files: one flag per mode).
_ST_MODES = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST", "last_token": "LAST"}
_ST_FLAGS = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # embeddings L2-normalized by default (a request may say otherwise)
    # Matryoshka: whether `dimensions` may shorten an embedding, and to which sizes (None: any).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


def read_pooler_config(model_dir: str | None, hf_config, encoder: bool) -> PoolerConfig:
    """The checkpoint's pooling, as sentence-transformers would pool it."""
    default = "CLS" if encoder else "LAST"
    pooling, normalize = None, False
    modules_path = None if model_dir is None else os.path.join(model_dir, "modules.json")
    if modules_path is not None and os.path.isfile(modules_path):
        modules = read_json(modules_path, modules_path)
        if not isinstance(modules, list):
            raise ValueError(f"{modules_path}: not a JSON list")
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            if kind.endswith("Normalize"):
                normalize = True
            elif kind.endswith("Pooling"):
                path = os.path.join(model_dir, str(module.get("path", "")), "config.json")
                if os.path.isfile(path):
                    pooling = _st_pooling(read_json(path, path), path)
    is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(pooling or default, normalize, is_matryoshka, tuple(dims) if dims else None)


def _st_pooling(cfg, path: str) -> str:
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        if mode.lower() not in _ST_MODES:
            raise ValueError(f"{path}: pooling_mode {mode!r} is not supported; supported: {sorted(_ST_MODES)}")
        return _ST_MODES[mode.lower()]
    for flag, kind in _ST_FLAGS.items():
        if cfg.get(flag):
            return kind
    raise ValueError(f"{path}: no supported pooling mode (mean, cls, lasttoken)")
