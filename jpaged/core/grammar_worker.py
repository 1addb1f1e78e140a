"""Grammar compilation in a worker process, under a time budget and a memory bound.

llguidance compiles some small grammars for minutes and gigabytes (measured: a 540-byte JSON
schema whose `allOf` intersects 21 `.*x.*` patterns, 87 s and 1 GB; time doubles per pattern),
and nothing in it bounds that: its fuel limits do not cover the emptiness checks, and a thread
cannot be stopped. So each new grammar is first translated, compiled and asked for its first
token mask here, in a child process with an address-space limit (RLIMIT_AS) that is killed when
the budget runs out. Only a grammar that passed is compiled again in the serving process (a
matcher cannot cross processes), where that compile is known to be quick.

The child imports no jax, torch or transformers: stdlib, llguidance and numpy only (~0.3 s to start).
Messages are length-prefixed pickles over its stdin and stdout.

The child runs isolated (`python -I`): no PYTHON* environment variables (PYTHONINSPECT, PYTHONWARNINGS,
PYTHONHASHSEED... set for the serving process), no user site-packages, and not this file's directory
first on sys.path (where a module could shadow the standard library's). -I also drops PYTHONPATH, which
may be the only way llguidance and numpy are importable (a checkout, or a `pip install --target DIR` tree
on PYTHONPATH): so the directories this process imports them from are given to the child as its
arguments, and it puts those its own sys.path lacks first, as PYTHONPATH would have (`_import_dirs`).
"""

import contextlib
import ctypes
import importlib.util
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import threading
import time

_LENGTH = struct.Struct(">Q")
_CHILD_MODULES = ("llguidance", "numpy")  # what the child imports besides the standard library


class GrammarLimitError(ValueError):
    """A grammar over the compile time budget or memory bound."""


class GrammarWorker:
    """`check(field, value)`: (llguidance grammar, bytes its compile took, whether it allows only the
    empty completion) of a guide, or ValueError (an invalid grammar) / GrammarLimitError (over a
    limit). One child at a time, started on first use and again after it was killed."""

    def __init__(self, tokenizer_args: tuple, timeout: float, memory_mib: int):
        self._tokenizer_args, self.timeout, self.memory_mib = tokenizer_args, timeout, memory_mib
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, field: str, value) -> tuple[str, int, bool]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                reply = self._call((field, value), self.timeout)
            except TimeoutError:
                self._kill()
                raise GrammarLimitError(f"the grammar took longer than grammar_compile_timeout={self.timeout:g} s "
                                        "to compile; simplify it") from None
            except EOFError:  # the child died: out of memory (Rust aborts) or killed
                status = self._kill()
                raise GrammarLimitError(f"compiling the grammar needed more than grammar_compile_memory="
                                        f"{self.memory_mib} MiB (worker exit status {status}); simplify it") from None
        kind, *rest = reply
        if kind == "ok":
            return tuple(rest)
        if kind == "memory":
            raise GrammarLimitError(f"compiling the grammar needed more than grammar_compile_memory="
                                    f"{self.memory_mib} MiB; simplify it")
        raise ValueError(f"not a valid grammar: {clean_error(rest[0])}")

    def _start(self):
        self._proc = subprocess.Popen([sys.executable, "-I", __file__, *_import_dirs()], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        try:  # building the tokenizer's trie takes about a second for a 150k vocabulary
            self._call((self._tokenizer_args, self.memory_mib), 120)
        except (TimeoutError, EOFError) as e:
            self._kill()
            raise RuntimeError(f"the grammar compile worker did not start ({e!r})") from None

    def _kill(self):
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        return proc.wait()

    def _call(self, message, timeout: float):
        _send(self._proc.stdin, message)
        return _receive(self._proc.stdout, time.monotonic() + timeout)


def _import_dirs() -> list[str]:
    """The directories (absolute sys.path entries) this process imports the child's modules from."""
    dirs = []
    for name in _CHILD_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue  # the child reports it: its import fails
        if spec.submodule_search_locations:  # a package: the entry is its directory's parent
            directory = os.path.dirname(os.path.normpath(next(iter(spec.submodule_search_locations))))
        elif spec.origin:
            directory = os.path.dirname(spec.origin)
        else:
            continue
        directory = os.path.abspath(directory)
        if directory not in dirs:
            dirs.append(directory)
    return dirs


def clean_error(message: str) -> str:
    """The grammar engine's message without its state dump, backtrace or source excerpt."""
    message = re.split(r"\n\s*(?:<state>|stack backtrace:|note: run with|\d+ \|)", str(message), maxsplit=1)[0]
    message = " ".join(message.replace("<non-verbose/>", "").split())
    return message if len(message) <= 300 else message[:297] + "..."


def _send(stream, message):
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream, deadline: float | None = None):
    """One message; EOFError when the other side is gone, TimeoutError past the deadline."""
    header = _read(stream.fileno(), _LENGTH.size, deadline)
    return pickle.loads(_read(stream.fileno(), _LENGTH.unpack(header)[0], deadline))


def _read(fd: int, size: int, deadline: float | None) -> bytes:
    data = b""
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer in time")
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        data += chunk
    return data


# ---------------------------------------------------------------------------- the child
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim():
    """Give freed heap back to the OS, so the next grammar's RSS growth is its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _main():
    import json
    import resource

    # The parent's directories for llguidance and numpy that -I left out, first (as PYTHONPATH puts
    # them); those the interpreter has anyway keep their place.
    sys.path[:0] = [d for d in dict.fromkeys(sys.argv[1:]) if d not in sys.path]
    import llguidance
    import llguidance.numpy
    import numpy as np

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    (tokenizer_json, n_vocab, eos), memory_mib = _receive(stdin)
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    with contextlib.suppress(OSError, ValueError):  # address space: what it has now plus the bound
        with open("/proc/self/status") as f:
            vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        limit = vm_size + memory_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _send(stdout, ("ready",))
    words = (tokenizer.vocab_size + 31) // 32
    while True:
        try:
            field, value = _receive(stdin)
        except EOFError:
            return
        try:
            _trim()
            before = _rss()
            if field == "guided_json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(value)
            elif field == "guided_regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            else:  # guided_choice: one of the strings, as a Lark grammar of JSON-quoted literals
                grammar = llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in value))
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                           limits=llguidance.LLParserLimits(verbose_errors=False))
            row = np.zeros((1, words), np.int32)
            if not matcher.is_error():  # some grammars fail only when asked for their first mask
                llguidance.numpy.fill_next_token_bitmask(matcher, row, 0)
            if matcher.is_error():
                reply = ("error", matcher.get_error())
            else:
                allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
                only_eos = len(allowed) > 0 and set(allowed.tolist()) <= eos_ids
                reply = ("ok", grammar, max(_rss() - before, len(grammar)), only_eos)
            del matcher
        except MemoryError:
            reply = ("memory",)
        except Exception as e:  # the translation rejects the schema or the regex
            reply = ("error", str(e))
        _send(stdout, reply)


if __name__ == "__main__":
    _main()
