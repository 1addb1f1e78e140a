"""Compiled executables kept on disk whole, so a restart skips tracing and lowering too.

jax's persistent compilation cache saves XLA's compile only: every start still traces and lowers
each step to find its cache key, about a second per step for a 30-layer model on a CPU. Here a compiled executable is serialized (jax.experimental.serialize_executable)
under a key made of everything that determines it: the jax and jaxlib versions, the backend and the
engine's devices (their ids: an executable runs on the devices it was compiled for), XLA's flags,
the source of jpaged and its kernels, the model's fingerprint (its config and dtype), the
executable's name, and its abstract arguments (shapes, dtypes, shardings, tree structure). Any
change makes a new key, so a stale executable is never loaded. Compiles here bypass jax's own cache:
an executable it loaded serializes without its CPU kernels (jax 0.10: "Function wrapped_iota not
found" when run after loading).

Nothing read from the directory reaches pickle or XLA unverified: a damaged executable can abort
the process inside XLA (one flipped bit: "LLVM ERROR: Unable to allocate section memory", SIGABRT,
on every restart). Each file holds its full key and a SHA-256 of its payload; a file that is not a
regular file, is too large, names another key or fails its checksum is a miss: a warning, the
executable compiled again and the file rewritten. A process that crashes while loading (a fatal
signal: SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE) leaves a marker with the crash recorded in it, and
the next start on that host loads nothing (crash loops end after one restart). A process stopped
while loading by any other signal (SIGTERM, SIGINT, even SIGKILL) records no crash: the next start
loads as usual. A read-only directory is only read.
"""

import contextlib
import faulthandler
import functools
import hashlib
import logging
import os
import pickle
import socket
import stat
import struct
import sys
import tempfile
import threading

import jax
import jaxlib
from jax._src import config as jax_config  # its context manager; jax.config.update is process-wide
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_PACKAGES = ("jpaged", "pallas_kernels")
MAX_CACHE_BYTES = 4 * 2**30
# A cache file: MAGIC, then the key's and the payload's lengths (two u64), the key (UTF-8), the
# payload's SHA-256 and the payload (a pickle of the devices and the serialized executable).
MAGIC = b"jpaged-executable-v2\n"
_LENGTHS = struct.Struct(">QQ")
_LOADING_MARKER = ".loading"  # .loading.<host>.<pid>: a start-up of that process is loading files
# A marker's second line when faulthandler writes into it: a crash (a fatal signal) appends its
# traceback there; a marker holding nothing after that line was left by a process stopped otherwise.
_CRASH_RECORD = "crash-record"
_MAX_MARKER_BYTES = 1 << 20


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

    def __init__(self, directory: str | None, model_fingerprint: str, devices: list | None = None,
                 compiler_options: dict | None = None):
        """`devices`: the engine's (its mesh's, in mesh order; default: all of jax's). An
        executable is compiled for its devices: their ids are part of the key, so one compiled
        for devices 2,3 is never loaded for 0,1 (nor on 2,3 in the other order).
        `compiler_options`: XLA options for every compile (over $XLA_FLAGS), part of the key."""
        self.compiler_options = dict(compiler_options or {})
        # Multi-host executables span other processes' devices: those always compile.
        self.directory = directory if jax.process_count() == 1 else None
        self.devices = list(jax.devices() if devices is None else devices)
        self._prefix = "\n".join([jax.__version__, jaxlib.__version__, jax.default_backend(),
                                  ",".join(sorted({d.device_kind for d in self.devices})),
                                  f"{jax.device_count()} devices; {','.join(str(d.id) for d in self.devices)}",
                                  os.environ.get("XLA_FLAGS", "") + "".join(
                                      f" {k}={v}" for k, v in sorted(self.compiler_options.items())),
                                  str(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision),
                                  source_fingerprint(), model_fingerprint])
        self.hits = 0
        self.rejected = 0  # files found damaged or under another key
        self._loading_depth = 0
        self.skip_loads = self.directory is not None and self._earlier_start_died()

    def compile(self, name: str, jitted, args: tuple):
        """The executable, loaded from disk or compiled now."""
        executable = self.load(name, args)
        return executable if executable is not None else self.compile_lowered(name, args, jitted.lower(*args))

    def load(self, name: str, args: tuple):
        """The executable an earlier run kept for `name` and `args`, or None."""
        if self.directory is None or self.skip_loads:
            return None
        key = self._key(name, args)
        path = self._path(key)
        try:
            payload = self._read_verified(path, key)
        except FileNotFoundError:
            return None
        except _Rejected as e:
            self.rejected += 1
            logger.warning("cached executable %s rejected (%s); compiling it again", path, e)
            return None
        except OSError as e:  # unreadable: permissions, I/O errors
            logger.warning("could not read the cached executable %s (%r); compiling it", path, e)
            return None
        try:
            with self.loading():
                device_ids, serialized = pickle.loads(payload)
                devices = {d.id: d for d in self.devices}  # the key names them: a file that names others
                if not set(device_ids) <= devices.keys():  # is foreign (or damaged past its checksum)
                    raise ValueError(f"it runs on devices {device_ids}, this engine on {sorted(devices)}")
                executable = serialize_executable.deserialize_and_load(
                    *serialized, execution_devices=[devices[i] for i in device_ids])
        except Exception as e:  # written by this key but not loadable here: compile it again
            logger.warning("could not load the cached executable %s (%r); compiling it", path, e)
            return None
        self.hits += 1
        with contextlib.suppress(OSError):  # recently used: pruned last (a read-only cache: not)
            os.utime(path)
        return executable

    @staticmethod
    def _read_verified(path: str, key: str) -> bytes:
        """The payload of the file at `path` if it holds `key` and its checksum matches, else
        _Rejected. Opened without blocking (a FIFO would never answer) and checked to be a regular
        file of a sane size before anything is read."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _Rejected("not a regular file")
            if info.st_size > MAX_CACHE_BYTES:
                raise _Rejected(f"{info.st_size} bytes")
            data = memoryview(f.read())  # slices below copy nothing
        header = len(MAGIC) + _LENGTHS.size
        if len(data) < header or data[:len(MAGIC)] != MAGIC:
            raise _Rejected("not a jpaged cache file of this version")
        key_len, payload_len = _LENGTHS.unpack_from(data, len(MAGIC))
        if len(data) != header + key_len + 32 + payload_len:
            raise _Rejected(f"{len(data)} bytes, the header says {header + key_len + 32 + payload_len}")
        if data[header:header + key_len] != key.encode():
            raise _Rejected("it holds another executable's key")
        digest, payload = data[header + key_len:header + key_len + 32], data[header + key_len + 32:]
        if hashlib.sha256(payload).digest() != digest:
            raise _Rejected("checksum mismatch")
        return payload

    @contextlib.contextmanager
    def loading(self):
        """Mark the directory while this process loads from it: a process that dies inside XLA
        leaves the marker, and the next start-up on this host loads nothing (_earlier_start_died).
        Reentrant: load() marks alone unless the warm-up marks all its loads at once."""
        self._loading_depth += 1
        marker = record = None
        try:  # from before the marker exists: a signal landing while it is written still removes it
            if self._loading_depth == 1 and self.directory is not None and not self.skip_loads:
                marker = os.path.join(self.directory, f"{_LOADING_MARKER}.{socket.gethostname()}.{os.getpid()}")
                with contextlib.suppress(OSError):  # a read-only directory: no marker, nothing to lose
                    os.makedirs(self.directory, exist_ok=True)
                    record = open(marker, "w")
                    guarded = _crash_records.watch(record)  # faulthandler writes a crash into it
                    record.write(_start_time(os.getpid()) + "\n" + (_CRASH_RECORD + "\n" if guarded else ""))
                    record.flush()
            yield
        finally:
            self._loading_depth -= 1
            if record is not None:
                _crash_records.unwatch(record)
                record.close()
            if marker is not None:
                with contextlib.suppress(OSError):
                    os.remove(marker)

    def _earlier_start_died(self) -> bool:
        """True when a process on this host crashed while loading executables from the directory
        (its marker is left, the process is gone, and the marker records a crash or, written by an
        older jpaged or while another marker of that process held the crash record, cannot say);
        the marker is removed. A marker of a process stopped by a signal that is no crash (SIGTERM,
        SIGKILL: nothing recorded after its header) is removed and the cache trusted."""
        prefix = f"{_LOADING_MARKER}.{socket.gethostname()}."
        died = False
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if not entry.name.startswith(prefix):
                    continue
                pid = entry.name[len(prefix):]
                with contextlib.suppress(OSError, ValueError):
                    fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
                    with os.fdopen(fd, "rb") as f:
                        content = f.read(_MAX_MARKER_BYTES).decode(errors="replace")
                    started, _, rest = content.partition("\n")
                    if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid), started):
                        continue  # that process is loading now
                    guarded, _, crash = rest.partition("\n")
                    # Empty: stopped between the marker's creation and its first line, before any load
                    # (a SIGKILL just after the URL line; the next start compiled everything again).
                    if guarded == _CRASH_RECORD and not crash.strip() or not content:
                        logger.info("an earlier start-up (pid %s) was stopped while loading cached executables from "
                                    "%s (a signal, not a crash): loading them as usual", pid, self.directory)
                    else:
                        logger.warning("an earlier start-up (pid %s) died while loading cached executables from %s%s: "
                                       "loading none this time, compiling every executable again", pid,
                                       self.directory, f" ({crash.strip().splitlines()[0]})" if crash.strip() else "")
                        died = True
                    os.remove(entry.path)
        return died

    def compile_lowered(self, name: str, args: tuple, lowered):
        """Compile `lowered` (jitted.lower(*args)) and keep the executable on disk. Thread-safe:
        the warm-up compiles in a worker thread while it lowers the next executables."""
        with jax_config.enable_compilation_cache(False):  # see the module's docstring
            executable = lowered.compile(compiler_options=self.compiler_options or None)
        if self.directory is None:
            return executable
        partial = None
        try:
            # Its devices too: a step on one of several devices must load onto that one.
            device_ids = [d.id for d in executable.runtime_executable().local_devices()]
            payload = pickle.dumps((device_ids, serialize_executable.serialize(executable)))
            key = self._key(name, args)
            key_bytes = key.encode()
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".tmp", delete=False) as f:
                partial = f.name
                f.write(MAGIC + _LENGTHS.pack(len(key_bytes), len(payload)) + key_bytes)
                f.write(hashlib.sha256(payload).digest() + payload)
            os.replace(partial, self._path(key))  # whole or not at all, also with several writers
            self._prune()
        except Exception as e:  # a read-only or full disk, a backend that cannot serialize: serve anyway
            if partial is not None and os.path.exists(partial):
                os.remove(partial)
            logger.warning("could not keep the executable %s on disk: %r", name, e)
        return executable

    def _key(self, name: str, args: tuple) -> str:
        """Everything that determines the executable, as text: kept whole in its file."""
        return f"{self._prefix}\n{name}\n{_abstract(args)}"

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, hashlib.sha256(key.encode()).hexdigest() + ".bin")

    def _prune(self):
        """Least recently used executables go once the directory holds more than MAX_CACHE_BYTES
        (each new jpaged version or model adds its own)."""
        entries = []
        for entry in os.scandir(self.directory):
            with contextlib.suppress(FileNotFoundError):  # another process may prune at the same time
                if entry.name.endswith(".bin") and entry.is_file(follow_symlinks=False):
                    entries.append((entry.stat().st_mtime, entry.stat().st_size, entry.path))
        excess = sum(size for _, size, _ in entries) - MAX_CACHE_BYTES
        for _, size, path in sorted(entries):
            if excess <= 0:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            excess -= size


class _CrashRecords:
    """faulthandler, while executables load, writes a fatal signal's traceback into the loading
    marker: the next start tells a crash (distrust the cache) from a process stopped by SIGTERM or
    SIGKILL (trust it). faulthandler writes to one file per process: the first marker opened; a
    marker opened while another is watched says it holds no record (then its death is taken for a
    crash). Afterwards faulthandler is set back as it was (on stderr when it was enabled)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._files: list = []
        self._was_enabled = False

    def watch(self, f) -> bool:
        """Start recording into `f` if no other marker is; whether `f` is the one recorded into."""
        with self._lock:
            if self._files:
                self._files.append(f)
                return False
            try:
                was_enabled = faulthandler.is_enabled()
                faulthandler.enable(file=f, all_threads=False)
            except (OSError, ValueError, RuntimeError):  # no file descriptor: no record
                return False
            self._was_enabled = was_enabled
            self._files.append(f)
            return True

    def unwatch(self, f):
        with self._lock:
            if f not in self._files:
                return
            recorded = self._files[0] is f
            self._files.remove(f)
            if not recorded:
                return
            with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
                if self._was_enabled:
                    faulthandler.enable(file=sys.__stderr__ or sys.stderr)
                else:
                    faulthandler.disable()
            self._files.clear()  # the others said they hold no record: nothing to hand over


_crash_records = _CrashRecords()


class _Rejected(Exception):
    """A cache file that must not be loaded (damaged, foreign, or not a regular file)."""


def _alive(pid: int, started: str) -> bool:
    """Process `pid` exists and started when the marker says (not a later process given its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    return started == _start_time(pid)


def _start_time(pid: int) -> str:
    """When process `pid` started (Linux: field 22 of /proc/PID/stat), so that a pid reused after a
    restart (a container's pid 1) is not taken for the process that left a marker; '' elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
