"""Each script whose imports are outside the base install checks them first and names what to
install in one line (scripts/reproduce_paper.py ran 17 minutes before its matplotlib import
failed); pyproject.toml has each extra it names."""

import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (script and arguments, the module made missing, what its error line must say)
CASES = [
    (["reproduce_paper.py", "--quick"], "matplotlib", 'pip install ".[bench]"'),
    (["bench_lora.py"], "peft", 'pip install ".[reference]"'),
    (["spec_coupling.py"], "torch", 'pip install ".[reference]"'),
    (["rl_rollout.py", "--steps", "1"], "optax", 'pip install ".[rl]"'),
    (["bench_throughput.py", "--random-llama", "25m"], "torch", 'pip install ".[reference]"'),
    (["make_fp8_kv_checkpoint.py", "tok", "out"], "llmcompressor", "pip install llmcompressor"),
    (["make_quantized_checkpoints.py", "tiny", "tok", "out"], "llmcompressor", "pip install llmcompressor"),
]
# Runs a script as `python scripts/NAME.py ARGS` does, with one module made impossible to import.
RUNNER = "import runpy, sys; sys.modules[sys.argv[1]] = None; sys.argv = sys.argv[2:]; " \
         "sys.path[0] = __import__('os').path.dirname(sys.argv[0]); runpy.run_path(sys.argv[0], run_name='__main__')"


@pytest.mark.parametrize("argv, module, install", CASES, ids=[c[0][0] for c in CASES])
def test_a_missing_extra_is_one_line_before_any_work(argv, module, install, tmp_path):
    script = os.path.join(ROOT, "scripts", argv[0])
    result = subprocess.run([sys.executable, "-c", RUNNER, module, script, *argv[1:]], capture_output=True,
                            text=True, cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: ") and install in lines[0], result.stderr[-2000:]
    assert module in lines[0] and not result.stdout
    assert not os.listdir(tmp_path)  # nothing written: it stopped first


def test_the_extras_named_exist():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for _, module, install in CASES:
        match = re.search(r'"\.\[(\w+)\]"', install)
        if match:
            assert module in extras[match.group(1)]
