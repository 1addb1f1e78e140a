"""`jpaged serve` answers what it can answer without a model before it imports one (issue 64): its
help, a misspelt flag, a bad value and a taken port come back from a process that never imported
jax, transformers or torch (those imports are most of a start's first seconds); the built-in model's
start imports nothing from transformers' model registry. And the probes' requests (/health,
/metrics) stay out of the access log unless the log level is debug."""

import json
import logging
import os
import socket
import subprocess
import sys

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from serving.access_log import ACCESS_LOGGER, ProbeQuietAccessLogger, access_log_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("jax", "transformers", "torch")

# Runs serving.cli.main(argv) as `jpaged` does, then prints its status and the heavy modules that
# were imported on the way (as JSON, on stdout's last line).
PROBE = """
import json, sys
from serving.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as e:
    status = e.code
print(json.dumps({"status": status, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def jpaged(*argv):
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["status"], report["heavy"], result.stdout, result.stderr


def test_help_imports_no_model_code():
    status, heavy, out, _ = jpaged("serve", "--help")
    assert status == 0 and heavy == []
    assert "--max-num-seqs" in out and "--tool-call-parser" in out and "MODEL" in out


def test_bad_flags_refused_before_model_code():
    status, heavy, _, err = jpaged("serve", "--model", "tiny", "--max-num-seq", "3")  # abbreviations are refused
    assert (status, heavy) == (2, []) and "unrecognized arguments: --max-num-seq" in err
    status, heavy, _, err = jpaged("serve", "tiny", "--max-num-seqs", "0")
    assert (status, heavy) == (2, []) and err.strip() == "error: max_num_seqs=0; expected >= 1"
    status, heavy, _, err = jpaged("serve", "tiny", "--chat-template", "/nonexistent/template.jinja")
    assert (status, heavy) == (2, []) and "--chat-template" in err
    status, heavy, _, err = jpaged("serve", "tiny", "--lora-modules", "no-equals-sign")
    assert (status, heavy) == (2, []) and "expected name=path" in err


def test_taken_port_refused_before_model_code():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, heavy, _, err = jpaged("serve", "tiny", "--port", str(port))
    assert (status, heavy) == (2, [])
    assert err.strip().startswith(f"error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


# The quick start's engine built as `jpaged serve --model tiny` builds it, after importing what the
# server imports; then which transformers packages were imported, and the tokenizer at work.
TINY_ENGINE = """
import json, sys
import serving.api_server, serving.cli, jpaged.pooling.engine
from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=4, max_model_len=128, enforce_eager=True))
tokenizer = engine.tokenizer
chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(json.dumps({"imported": sorted(m for m in sys.modules if m.startswith("transformers.models")),
                  "config": [type(engine.hf_config).__name__, engine.hf_config.model_type],
                  "chat": chat, "ids": tokenizer.encode("hé")}))
"""


def test_tiny_start_skips_transformers_model_registry():
    """Importing any class under transformers.models (AutoConfig, AutoTokenizer, LlamaConfig) makes
    transformers index that package's ~1,700 files a second time, about 0.4 s of a 2 s start:
    the built-in model's start imports none, whatever the server's modules import at their top."""
    result = subprocess.run([sys.executable, "-c", TINY_ENGINE], capture_output=True, text=True, cwd=ROOT,
                            timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["imported"] == [] and report["config"] == ["TinyLlamaConfig", "llama"]
    assert report["chat"] == "<s><|user|>\nhi</s>\n<|assistant|>\n" and report["ids"] == [256, 104, 195, 169]


# `jpaged serve` up to the server's start, which reports the cyclic collector's state instead of serving.
COLLECTOR = """
import gc, json, sys
import serving.api_server
serving.api_server.run_server = lambda config, options: print(json.dumps(
    {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "jax": "jax" in sys.modules}))
from serving.cli import main
main(["serve", "tiny", "--port", "0"])
"""


def test_serve_freezes_its_imports_and_leaves_the_collector_on():
    result = subprocess.run([sys.executable, "-c", COLLECTOR], capture_output=True, text=True, cwd=ROOT,
                            timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["enabled"] and report["jax"] and report["frozen"] > 100_000  # the imported modules' objects


FREEZE_HEAP = """
import gc, json, weakref
from jpaged.engine import start_up

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.b, b.a = b, a
    return [a], weakref.ref(a)

gc.disable()
held, before = cycle()
held = None  # garbage, frozen before any engine (as `jpaged serve` freezes its imports)
gc.freeze()
engine, engine_ref = cycle()
start_up.freeze_heap()  # the first engine's start-up
after_first = [before() is not None, engine_ref() is not None]
engine = None  # that engine dropped
start_up.freeze_heap()  # the next engine's start-up
print(json.dumps({"after_first": after_first, "after_second": [before() is not None, engine_ref() is not None]}))
"""


def test_engine_start_up_freezes_its_heap_and_lets_a_dropped_engine_go():
    """The first engine walks only what nobody froze (jpaged serve's imports stay out of that pass);
    a later one unfreezes first, so what an earlier, dropped engine froze is collected."""
    result = subprocess.run([sys.executable, "-c", FREEZE_HEAP], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"after_first": [True, True], "after_second": [False, False]}


def access_lines(level: int, caplog) -> list[str]:
    logger = logging.getLogger(ACCESS_LOGGER)
    access = ProbeQuietAccessLogger(logger, '"%r" %s')
    caplog.clear()
    with caplog.at_level(level, logger=ACCESS_LOGGER):
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("GET", "/health?verbose=1"), ("GET", "/v1/models")):
            access.log(make_mocked_request(method, path), web.Response(status=200), 0.01)
    return [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]


def test_probes_not_access_logged_unless_debug(caplog):
    assert access_lines(logging.INFO, caplog) == ['"POST /v1/completions HTTP/1.1" 200', '"GET /v1/models HTTP/1.1" 200']
    assert access_lines(logging.DEBUG, caplog) == [
        '"GET /health HTTP/1.1" 200', '"GET /metrics HTTP/1.1" 200', '"POST /v1/completions HTTP/1.1" 200',
        '"GET /health?verbose=1 HTTP/1.1" 200', '"GET /v1/models HTTP/1.1" 200']


def test_access_log_options():
    assert access_log_options(False) == {"access_log": None}  # --disable-log-requests: no line at all
    on = access_log_options(True)
    assert on["access_log"] is logging.getLogger(ACCESS_LOGGER) and on["access_log_class"] is ProbeQuietAccessLogger
