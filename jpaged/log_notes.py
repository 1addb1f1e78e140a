"""Notes logged once per process about noise jpaged cannot turn off alone (logging setup: the
transformers advice is silenced in jpaged/__init__.py, jax's backend INFO lines in serving/cli.py)."""

import logging

import jax

logger = logging.getLogger("jpaged.engine.llm_engine")
_explained: set[str] = set()


def explain_slow_compile_alarm():
    """XLA logs "Very slow compile? If you want to file a bug..." (an E line from C++; no option
    turns off that one alone) when a step takes long to compile, which on a busy CPU is normal:
    said once per process, before it can appear."""
    if "slow_compile" not in _explained and jax.devices()[0].platform == "cpu":
        _explained.add("slow_compile")
        logger.info("compiling steps on a CPU: if XLA logs 'Very slow compile?', it is harmless (a busy CPU); "
                    "compiled steps are kept on disk for the next start (executable_cache)")
