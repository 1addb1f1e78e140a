"""Compiled executables kept on disk whole, so a restart skips tracing and lowering too.

jax's persistent compilation cache saves XLA's compile only: every start still traces and lowers
each step to find its cache key, about a second per step for a 30-layer model on a CPU. Here a compiled executable is serialized (jax.experimental.serialize_executable)
under a key made of everything that determines it: the jax and jaxlib versions, the backend and its
devices, XLA's flags, the source of jpaged and its kernels, the model's fingerprint (its config and dtype), the
executable's name, and its abstract arguments (shapes, dtypes, shardings, tree structure). Any
change makes a new key, so a stale executable is never loaded; one that fails to load is compiled
again and rewritten. Compiles here bypass jax's own cache: an executable it loaded serializes
without its CPU kernels (jax 0.10: "Function wrapped_iota not found" when run after loading).
"""

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile

import jax
import jaxlib
from jax._src import config as jax_config  # its context manager; jax.config.update is process-wide
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_PACKAGES = ("jpaged", "pallas_kernels")
MAX_CACHE_BYTES = 4 * 2**30


@functools.cache
def source_fingerprint() -> str:
    """A hash of every Python file of jpaged and its kernels: new code, new keys."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = os.path.dirname(__import__(package).__file__)
        for directory, _, files in sorted(os.walk(root)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(directory, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def _abstract(args) -> str:
    """The arguments as the compiler sees them: tree structure, shapes, dtypes, shardings."""
    leaves, treedef = jax.tree.flatten(args)
    return repr(treedef) + "".join(
        f"|{leaf.shape}{leaf.dtype}{getattr(leaf, 'sharding', None)}" for leaf in leaves)


class ExecutableCache:
    """`compile(name, jitted, args)`: the jitted function's executable for `args` (arrays or
    ShapeDtypeStructs), from `directory` when an earlier run left it there. directory=None: compile."""

    def __init__(self, directory: str | None, model_fingerprint: str):
        # Multi-host executables span other processes' devices: those always compile.
        self.directory = directory if jax.process_count() == 1 else None
        devices = jax.devices()
        self._prefix = "\n".join([jax.__version__, jaxlib.__version__, jax.default_backend(),
                                  ",".join(sorted({d.device_kind for d in devices})), str(len(devices)),
                                  os.environ.get("XLA_FLAGS", ""),
                                  str(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision),
                                  source_fingerprint(), model_fingerprint])
        self.hits = 0

    def compile(self, name: str, jitted, args: tuple):
        """The executable, loaded from disk or compiled now."""
        executable = self.load(name, args)
        return executable if executable is not None else self.compile_lowered(name, args, jitted.lower(*args))

    def load(self, name: str, args: tuple):
        """The executable an earlier run kept for `name` and `args`, or None."""
        if self.directory is None:
            return None
        path = self._path(name, args)
        try:
            with open(path, "rb") as f:
                device_ids, serialized = pickle.load(f)
            devices = {d.id: d for d in jax.devices()}
            executable = serialize_executable.deserialize_and_load(
                *serialized, execution_devices=[devices[i] for i in device_ids])
        except FileNotFoundError:
            return None
        except Exception as e:  # a truncated or foreign file: compile it again
            logger.warning("could not load the cached executable %s (%r); compiling it", path, e)
            return None
        self.hits += 1
        os.utime(path)  # recently used: pruned last
        return executable

    def compile_lowered(self, name: str, args: tuple, lowered):
        """Compile `lowered` (jitted.lower(*args)) and keep the executable on disk. Thread-safe:
        the warm-up compiles in a worker thread while it lowers the next executables."""
        with jax_config.enable_compilation_cache(False):  # see the module's docstring
            executable = lowered.compile()
        if self.directory is None:
            return executable
        partial = None
        try:
            # Its devices too: a step on one of several devices must load onto that one.
            device_ids = [d.id for d in executable.runtime_executable().local_devices()]
            data = pickle.dumps((device_ids, serialize_executable.serialize(executable)))
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as f:
                partial = f.name
                f.write(data)
            os.replace(partial, self._path(name, args))  # whole or not at all, also with several writers
            self._prune()
        except Exception as e:  # a read-only or full disk, a backend that cannot serialize: serve anyway
            if partial is not None and os.path.exists(partial):
                os.remove(partial)
            logger.warning("could not keep the executable %s on disk: %r", name, e)
        return executable

    def _path(self, name: str, args: tuple) -> str:
        key = hashlib.sha256(f"{self._prefix}\n{name}\n{_abstract(args)}".encode()).hexdigest()
        return os.path.join(self.directory, key + ".bin")

    def _prune(self):
        """Least recently used executables go once the directory holds more than MAX_CACHE_BYTES
        (each new jpaged version or model adds its own)."""
        entries = []
        for entry in os.scandir(self.directory):
            with contextlib.suppress(FileNotFoundError):  # another process may prune at the same time
                if entry.name.endswith(".bin"):
                    entries.append((entry.stat().st_mtime, entry.stat().st_size, entry.path))
        excess = sum(size for _, size, _ in entries) - MAX_CACHE_BYTES
        for _, size, path in sorted(entries):
            if excess <= 0:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            excess -= size
