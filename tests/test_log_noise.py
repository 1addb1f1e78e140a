"""What a CPU run logs is what is true there: no PyTorch advice from transformers (jpaged needs
only its tokenizers) while its real warnings still show, a stats line that does not call a CPU's
pool "GPU KV cache", and XLA's "Very slow compile?" alarm explained once."""

import logging
import os
import subprocess
import sys

from jpaged import log_notes
from serving.api_server import stats_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_pytorch_advice_but_real_warnings_show():
    code = ("import sys; sys.modules['torch'] = None\n"  # a machine without PyTorch, as `pip install .` leaves it
            "import jpaged, jpaged.llm\n"
            "from transformers.utils import logging\n"
            "logging.get_logger('transformers').warning('a real warning')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "PyTorch was not found" not in result.stderr and "a real warning" in result.stderr


def test_stats_line_names_the_device():
    stats = dict(num_running=3, num_swapped=1, num_waiting=2, num_gpu_blocks=200, num_free_gpu_blocks=150,
                 num_cpu_blocks=100, num_free_cpu_blocks=90)
    cpu = stats_line(stats, 12.34, 56.78, "cpu")
    assert cpu == ("Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 56.8 tokens/s, Running: 3 reqs, "
                   "Swapped: 1 reqs, Pending: 2 reqs, KV cache usage: 25.0%, swap space usage: 10.0%")
    assert "GPU" not in cpu
    gpu = stats_line({**stats, "num_cpu_blocks": 0, "num_free_cpu_blocks": 0}, 0, 0, "gpu")
    assert gpu.endswith("GPU KV cache usage: 25.0%, CPU KV cache usage: 0.0%")  # vLLM's words on a GPU


def test_slow_compile_alarm_explained_once(monkeypatch, caplog):
    monkeypatch.setattr(log_notes, "_explained", set())
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            log_notes.explain_slow_compile_alarm()
    assert sum("'Very slow compile?'" in r.getMessage() and "harmless" in r.getMessage()
               for r in caplog.records) == 1
