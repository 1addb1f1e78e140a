"""Checkpoint loading errors: each names what is wrong."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jpaged
from jpaged.models.loader import MODEL_REGISTRY, resolve_dtype
from test_models import make_checkpoint


@pytest.fixture()
def checkpoint(tmp_path):
    make_checkpoint(tmp_path, "llama2-mha")
    return tmp_path


def edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as e:
        jpaged.LLM(str(checkpoint))
    assert all(arch in str(e.value) for arch in MODEL_REGISTRY)


def test_missing_tensor(checkpoint):
    edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight \(shape \(96, 64\)\)"):
        jpaged.LLM(str(checkpoint))


def test_wrong_shape(checkpoint):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    edit_tensors(checkpoint, shrink)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(48, 64\).*expected \(64, 64\)"):
        jpaged.LLM(str(checkpoint))


def test_unexpected_tensor(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        jpaged.LLM(str(checkpoint))


def test_bad_model_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        jpaged.LLM(str(tmp_path / "does-not-exist"))
    with pytest.raises(ValueError, match="dtype='float8'"):
        resolve_dtype("float8", None)
    with pytest.raises(ValueError, match="block_size=7"):
        jpaged.LLM("tiny", block_size=7)
    with pytest.raises(ValueError, match="unknown engine argument"):
        jpaged.LLM("tiny", max_num_sequences=3)
