"""One replica's process, as the front end (fleet.py) sees it: a fresh interpreter running
jpaged.data_parallel.replica with its own devices, two one-way pipes (commands in, messages out),
a reader and a writer thread, and when it last said anything (its heartbeats included)."""

import dataclasses
import multiprocessing.connection
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Callable

from jpaged.config import EngineConfig

# How long a replica may take to stop after the shutdown command before it is killed.
SHUTDOWN_TIMEOUT_S = 30


def replica_env(config: EngineConfig, rank: int) -> dict:
    """The environment of replica `rank`'s process: its own tensor_parallel_size devices. On a
    GPU, CUDA_VISIBLE_DEVICES (so jax in that process sees, and preallocates, only those); on
    the CPU each process has its own host devices (as many as tensor parallelism needs)."""
    tp, env = config.tensor_parallel_size, {}
    ids = [d if isinstance(d, int) else d.id for d in config.devices] if config.devices else \
        list(range(config.data_parallel_size * tp))
    mine = ids[rank * tp:(rank + 1) * tp]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # ids count within what this process was given
        given = [v.strip() for v in visible.split(",") if v.strip()]
        mine = [given[i] if i < len(given) else str(i) for i in mine]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, mine))
    flags = os.environ.get("XLA_FLAGS", "")
    if tp > 1 and "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={tp}".strip()
    return env


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Replica `rank`'s own engine options: one replica, its rank, its devices (set by replica_env)."""
    return dataclasses.replace(config, data_parallel_size=1, data_parallel_rank=rank, devices=None)


class ReplicaProcess:
    """One replica's process (a fresh interpreter: jax is not fork-safe, and unlike
    multiprocessing's spawn nothing of the caller's __main__ is imported again) and its pipes."""

    def __init__(self, rank: int, config: EngineConfig, lora_modules, post: Callable, on_message: Callable):
        commands_read, commands_write = os.pipe()
        messages_read, messages_write = os.pipe()
        env = {**os.environ, **replica_env(config, rank)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jpaged.data_parallel.replica", str(rank), str(commands_read), str(messages_write)],
            env=env, pass_fds=(commands_read, messages_write), stdin=subprocess.DEVNULL)
        os.close(commands_read)  # the child's ends: once it exits, our reads see EOF
        os.close(messages_write)
        self.rank, self.pid = rank, self.process.pid
        self.last_seen = time.monotonic()  # its last message or heartbeat (the reader thread sets it)
        self._commands = multiprocessing.connection.Connection(commands_write, readable=False)
        self._messages = multiprocessing.connection.Connection(messages_read, writable=False)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox.put(pickle.dumps((replica_config(config, rank), list(lora_modules))))  # read first
        self._post, self._on_message = post, on_message
        threading.Thread(target=self._read, name=f"jpaged-replica-{rank}-reader", daemon=True).start()
        threading.Thread(target=self._write, name=f"jpaged-replica-{rank}-writer", daemon=True).start()

    def send(self, command: tuple):
        self._outbox.put(command)

    def _write(self):
        while True:
            command = self._outbox.get()
            if command is None:
                break
            try:
                if isinstance(command, bytes):
                    self._commands.send_bytes(command)
                else:
                    self._commands.send(command)
            except (OSError, ValueError):  # the replica is gone: its reader reports it
                break
        self._commands.close()

    def _read(self):
        while True:
            try:
                message = self._messages.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # a message that cannot be unpickled: the replica cannot be trusted
                message = ("fatal", f"unreadable message: {e!r}", "")
            self.last_seen = time.monotonic()
            if message == ("heartbeat",):
                continue
            self._post(lambda m=message: self._on_message(self, m))
        self._messages.close()
        self._post(lambda: self._on_message(self, ("exit",)))

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S):
        """Ask the process to stop; kill it if it has not after `timeout` seconds."""
        self.send(("shutdown",))
        self.send(None)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.send(None)
