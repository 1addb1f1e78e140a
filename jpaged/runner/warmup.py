"""The warm-up: every executable compiled (or loaded from the executable cache) in order of need,
in the foreground (`run`) or in a background thread while the engine already serves (`start`).

Order of need (`need_order`): what any step needs first (the block operations, the history upload,
a LoRA slot write), then per token bucket its forward, its multi-step decode and the samplers of
its row bucket: the one a full decode batch needs, then the others ascending, the largest last. A token bucket is *ready* once all of
that is in (`ready_tokens`): the scheduler caps each step at the largest ready bucket, and the
runner pads steps to ready buckets only, so serving never waits for a compile nor compiles a shape
itself. A compile that fails is logged and its shape left out; a request that needs it gets the
error (ModelRunner._executable), the others go on with the shapes there are.

The pipeline: this thread traces and lowers the executables in order (Python; tracing in several
threads once hung in CI) while `compile_threads()` worker threads run XLA's compiles (C++, without
the GIL) side by side, taken in order of need. A bucket is ready once all of its executables are
in, whichever finished first. One compile at a time by default; on a GPU XLA autotunes each
compile's fusions on the device, under a per-device lock, and compiles autotuning side by side
have hit its profiler's DelayKernel timeouts (openxla/xla PRs 41399, 42347, 42415; docs/PERF.md,
"Warm-up compile time, deviceless H200"). $JPAGED_WARMUP_COMPILE_THREADS sets the number anywhere.
"""

import concurrent.futures
import logging
import os
import sys
import threading
import time
import weakref

import jax

logger = logging.getLogger(__name__)

# The number of XLA compiles run side by side (default: compile_threads()).
THREADS_ENV = "JPAGED_WARMUP_COMPILE_THREADS"
MAX_COMPILE_THREADS = 8  # (each compile holds its own memory; XLA's compiler also has threads of its own)

# Fault injection for the tests: compiles of keys whose repr contains one of these ';'-separated
# strings fail (as a compiler error would).
FAIL_ENV = "JPAGED_INJECT_COMPILE_FAILURE"


def compile_threads(platform: str) -> int:
    """How many compiles the warm-up runs side by side: $JPAGED_WARMUP_COMPILE_THREADS if set (at
    least 1, at most MAX_COMPILE_THREADS); else 1. On a GPU each compile autotunes on the device
    (the module's docstring); on a CPU two threads measured no gain on this project's 2-core
    machine (tiny: wall 1.17x, a 25M checkpoint 1.02x, CPU seconds the same), so side by side is
    asked for, not assumed. `platform` is kept for a measured per-platform default."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return 1
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= MAX_COMPILE_THREADS:
        raise ValueError(f"{THREADS_ENV} must be a whole number from 1 to {MAX_COMPILE_THREADS}, not {value!r}")
    return threads


def need_order(buckets, forward_keys, base_keys: list) -> list:
    """Every executable, in the order a serving engine needs them: `base_keys` (any step may need
    them), then per token bucket (smallest first) its forwards (`forward_keys(tokens)`), multi-step
    decode and samplers."""
    order = list(base_keys)
    for tokens in token_order(buckets):
        order += [k for k in step_keys(buckets, forward_keys, tokens) if k not in order]
    return order


def token_order(buckets) -> list[int]:
    """The token bucket that holds a decode of max_num_seqs sequences first (a first request runs
    padded to it, and every stream that follows decodes together), then the others ascending: the
    smallest next, the largest prefill chunks last."""
    decode = next(t for t in buckets.tokens if t >= buckets.max_num_seqs)
    return [decode] + [t for t in buckets.tokens if t != decode]


def step_keys(buckets, forward_keys, tokens: int) -> list:
    """The executables a step padded to `tokens` may run."""
    rows = buckets.sample_rows(tokens)
    keys = list(forward_keys(tokens))
    if buckets.num_scheduler_steps > 1 and tokens in buckets.decode_tokens:
        keys.append(("multi_step", tokens))
    return keys + [("sample", rows, False, "greedy"), ("sample", rows, False), ("sample", rows, True)]


def _abstract(tree):
    """Arrays as ShapeDtypeStructs: serving donates the live ones while the background lowers."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                       weak_type=getattr(x, "weak_type", False))
                        if isinstance(x, jax.Array) else x, tree)


def _lower_priority():
    """A background compile yields the cores to serving (Linux: threads have their own nice value;
    the compiler's own threads inherit it). On idle cores it changes nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the same priority
        pass


BACKGROUND_NICE = 10
# While the background warm-up runs, Python switches threads every SWITCH_INTERVAL_S instead of
# every 5 ms: the warm-up's threads (lowering, the compiles' Python parts) hold the GIL while the
# serving thread waits for it after each device call. Measured on 2 cores (tiny, 16 streams while
# warming): 26-32% -> 47-51% of the warm throughput (docs/PERF.md). Set back when it ends.
SWITCH_INTERVAL_S = 0.0005
_switch = {"warming": 0, "former": None}  # background warm-ups running in this process, and the interval before
_switch_lock = threading.Lock()


def _fast_switching(on: bool):
    """The first background warm-up in sets SWITCH_INTERVAL_S; the last out sets the former back."""
    with _switch_lock:
        if on:
            if not _switch["warming"]:
                _switch["former"] = sys.getswitchinterval()
                sys.setswitchinterval(min(_switch["former"], SWITCH_INTERVAL_S))
            _switch["warming"] += 1
        else:
            _switch["warming"] -= 1
            if not _switch["warming"]:
                sys.setswitchinterval(_switch["former"])


def _renice_native_threads(nice: int | None = BACKGROUND_NICE, saved: dict | None = None) -> dict:
    """XLA's own compile threads: unnamed C++ threads (their name is the process's) that XLA starts
    before the warm-up, so they keep the nice value of the thread that made them. Measured on a
    2-core CPU (tiny, 16 streams while warming): two of them took most of a core at nice 0 while
    steps ran 2.7x slower. They get `nice` here; the threads that run steps (XLA's named pools,
    tf_*) and Python's own threads keep theirs. Returns {thread id: former nice}; with `saved`,
    puts those back instead (a lower value takes privileges: without them these compile threads stay
    at the background's nice). Linux only; elsewhere nothing."""
    if saved is not None:
        for tid, value in saved.items():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, value)
            except OSError:  # the thread ended
                pass
        return {}
    try:
        process = open("/proc/self/comm").read().strip()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    python = {t.native_id for t in threading.enumerate()}
    former = {}
    for tid in tids:
        try:
            if tid in python or open(f"/proc/self/task/{tid}/comm").read().strip() != process:
                continue
            value = os.getpriority(os.PRIO_PROCESS, tid)
            if value < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                former[tid] = value
        except OSError:  # ended meanwhile, or not allowed
            continue
    return former


class WarmUp:
    """Compiles `keys` (in order) into `runner._executables`. `stop`: checked between shapes;
    in the foreground it raises SystemExit(0) (the server's start-up signal), in the background
    the thread ends after the compiles under way (whose cache files are written whole or not at
    all). `threads`: compiles side by side (default: compile_threads() for the runner's devices)."""

    def __init__(self, runner, keys: list, base_keys: list, stop: threading.Event | None = None,
                 threads: int | None = None):
        # The runner, weakly: it holds its warm-up (`ModelRunner.warmup`), and a cycle would keep a
        # dropped engine's runner and KV pool (engine/start_up.freeze_heap). The thread holds it while it runs.
        self._runner = weakref.ref(runner)
        self.executables, self.cache = runner._executables, runner.executable_cache  # (the runner's own)
        self.keys, self.base_keys = keys, base_keys
        self.stop = stop if stop is not None else threading.Event()
        self._abandoned = False  # its engine was dropped (`abandon`)
        self.failed: dict = {}  # key -> the exception its compile raised
        self.done = threading.Event()
        self.progress = threading.Condition()
        self._thread = None
        self._ready: list[int] = []
        self._background = False
        self._reniced = None  # XLA's threads given BACKGROUND_NICE once steps can run: {id: former nice}
        self._renice_lock = threading.Lock()
        self._lock = threading.Lock()  # the compile threads' results: executables, failed, _ready
        mesh = getattr(runner, "mesh", None)
        self.threads = threads or compile_threads(mesh.devices.flat[0].platform if mesh is not None else "cpu")
        failing = os.environ.get(FAIL_ENV, "")
        self._failing = [s for s in failing.split(";") if s]

    @property
    def runner(self):
        """The runner (None once dropped)."""
        return self._runner()

    # ------------------------------------------------------------------ progress
    @property
    def total(self) -> int:
        return len(self.keys)

    @property
    def compiled(self) -> int:
        return sum(k in self.executables for k in self.keys)

    @property
    def remaining(self) -> int:
        """Executables neither compiled nor failed yet."""
        return 0 if self.done.is_set() else max(0, self.total - self.compiled - len(self.failed))

    @property
    def ready(self) -> bool:
        """Everything compiled (False after a failure: some shapes are missing)."""
        return self.done.is_set() and not self.failed

    def ready_tokens(self) -> list[int]:
        """The token buckets every executable of a step is in for (empty until the base keys are
        compiled or failed)."""
        return self._ready

    def _update(self):
        runner, have, failed = self.runner, self.executables, self.failed
        with self._lock:  # (compile threads finish side by side: the last to look writes the newest)
            if runner is not None and all(k in have or k in failed for k in self.base_keys):
                buckets = runner.buckets
                self._ready = [t for t in buckets.tokens
                               if all(k in have for k in step_keys(buckets, runner.forward_keys, t))]
        # Once steps can run, XLA's compile threads yield the cores to them; before, nothing serves,
        # and the first executables compile at full speed.
        if self._background and self._ready and not self.done.is_set():
            with self._renice_lock:
                if self._reniced is None:
                    self._reniced = _renice_native_threads()
        with self.progress:
            self.progress.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the warm-up ended (True) or `timeout` seconds."""
        return self.done.wait(timeout)

    def wait_for(self, key):
        """Until `key` is compiled or failed (or the warm-up ended): for a base key asked for before
        the first step (a LoRA slot written as the server registers its adapters), which would
        otherwise be compiled twice. The base keys come first: a short wait."""
        with self.progress:
            while key not in self.executables and key not in self.failed and not self.done.is_set():
                self.progress.wait(0.5)

    def wait_for_progress(self, timeout: float):
        with self.progress:
            if not self.done.is_set():
                self.progress.wait(timeout)

    # ------------------------------------------------------------------ running it
    def start(self):
        """Compile in a background thread; serving goes on meanwhile."""
        self._background = True
        self._thread = threading.Thread(target=self._run_logged, name="jpaged-warmup", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = None):
        """Stop after the compiles under way (their files are written whole) and wait for them."""
        self.stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run_logged(self):
        _lower_priority()
        start = time.perf_counter()
        _fast_switching(True)
        try:
            self.run()
            logger.info("warm-up done: %d of %d step executables in %.1f s (%d loaded from the executable cache)%s",
                        self.compiled, self.total, time.perf_counter() - start, self.cache.hits,
                        f"; {len(self.failed)} failed" if self.failed else "")
        except BaseException:  # never reached by design; logged rather than lost in a thread
            logger.exception("the background warm-up failed")
        finally:
            with self._renice_lock:
                _renice_native_threads(saved=self._reniced or {})
                self._reniced = {}
            self.done.set()
            _fast_switching(False)  # (after `done`: while it is unset, the interval is the warm-up's)
            self._update()

    def abandon(self):
        """Its engine was dropped: end after the compile under way (the thread holds the runner until
        then), leaving `stop` unset (the server's start-up event: a later engine may share it)."""
        self._abandoned = True

    def _stopping(self) -> bool:
        return self.stop.is_set() or self._abandoned

    def _check_stop(self):
        if self._stopping():
            raise SystemExit(0)

    def run(self):
        """Load what the executable cache has, then compile the rest: pipelined, in order of need.
        In the foreground, the first failure is raised once the others are done."""
        from tqdm.auto import tqdm

        runner, cache = self.runner, self.cache
        if runner is None:  # dropped before its warm-up began
            return
        keys = [k for k in self.keys if k not in self.executables]
        pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="jpaged-compile")
        try:
            with tqdm(total=len(keys), desc="Compiling step buckets", unit="shape",
                      disable=self._background) as bar:
                missing = []
                with cache.loading():  # loads first, under one marker (a crash in XLA is seen next start)
                    for key in keys:
                        self._check_stop()
                        try:
                            jitted, args = runner._jitted_and_args(key)
                            args = _abstract(args)
                            executable = cache.load(repr(key), args)
                        except Exception as e:
                            self._fail(key, e)
                            continue
                        if executable is not None:
                            self._add(key, executable, bar)
                        else:
                            missing.append((key, jitted, args))
                futures = []
                for key, jitted, args in missing:
                    self._check_stop()
                    try:
                        self._inject(key)
                        lowered = jitted.lower(*args)
                    except Exception as e:
                        self._fail(key, e)
                        continue
                    try:
                        futures.append(pool.submit(self._compile, key, args, lowered, bar))
                    except RuntimeError:  # the interpreter is exiting: its compile worker was stopped
                        return
                for future in futures:
                    while not concurrent.futures.wait([future], timeout=0.25).done:
                        self._check_stop()
                self._check_stop()  # (stopped while the last compiles ran: those queued returned at once)
        except SystemExit:
            if not self._background:
                raise
        finally:  # SIGTERM: the running compiles finish (their files written whole), the queued ones are dropped
            pool.shutdown(wait=True, cancel_futures=True)
            if not self._background:
                self.done.set()
            self._update()
        if self.failed and not self._background:
            raise next(iter(self.failed.values()))

    def _compile(self, key, args, lowered, bar):
        if self._stopping():
            return
        if self._background:
            _lower_priority()
        try:
            executable = self.cache.compile_lowered(repr(key), args, lowered)
        except Exception as e:
            self._fail(key, e)
            return
        self._add(key, executable, bar)

    def _add(self, key, executable, bar):
        with self._lock:
            self.executables[key] = executable
            bar.update()
        self._update()

    def _inject(self, key):
        if any(s in repr(key) for s in self._failing):
            raise RuntimeError(f"injected compile failure ({FAIL_ENV})")

    def _fail(self, key, error: Exception):
        with self._lock:
            self.failed[key] = error
        if self._background:
            logger.error("compiling step shape %s failed: %r; requests that need it get this error, the others are "
                         "served on the shapes there are", key, error, exc_info=error)
        self._update()
