"""The warm-up's compiles side by side (runner/warmup.py, $JPAGED_WARMUP_COMPILE_THREADS), on a
fake runner whose compiles sleep: lowering stays on the warm-up's one thread, in order of need;
compiles start in that order, up to N at once; a bucket is ready only once every executable of its
step is in, however the compiles finish, and readiness never goes back; a failed compile is
logged and its buckets left out; stopping ends after the compiles under way; no compile thread
outlives the warm-up."""

import contextlib
import logging
import threading
import time

import pytest

from jpaged.runner import warmup
from jpaged.runner.buckets import Buckets
from jpaged.runner.warmup import FAIL_ENV, THREADS_ENV, WarmUp, compile_threads, need_order, step_keys


class FakeCache:
    hits = 0

    def __init__(self, runner):
        self.runner = runner

    @contextlib.contextmanager
    def loading(self):
        yield

    def load(self, name, args):
        return None

    def compile_lowered(self, name, args, lowered):
        return self.runner.compile(lowered)


class FakeJitted:
    def __init__(self, runner, key):
        self.runner, self.key = runner, key

    def lower(self, *args):
        self.runner.lowered.append((self.key, threading.current_thread().name))
        return self.key


class FakeRunner:
    """Buckets of a small engine; every compile sleeps `delay` (`slow`: these keys longer)."""

    def __init__(self, delay=0.03, slow=None):
        self.buckets = Buckets.create(max_num_seqs=4, max_num_batched_tokens=16, max_blocks_per_seq=4,
                                      max_model_len=64)
        self._executables = {}
        self.executable_cache = FakeCache(self)
        self.delay, self.slow = delay, dict(slow or {})
        self.lowered, self.started, self.finished = [], [], []
        self.running = self.most_running = 0
        self.lock = threading.Lock()

    def forward_keys(self, tokens):
        return [("forward", tokens)]

    def base_keys(self):
        return [k for k in self.buckets.keys() if k[0] not in ("forward", "multi_step", "sample")]

    def order(self):
        return need_order(self.buckets, self.forward_keys, self.base_keys())

    def _jitted_and_args(self, key):
        return FakeJitted(self, key), ()

    def compile(self, key):
        with self.lock:
            self.started.append(key)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.slow.get(key, self.delay))
        with self.lock:
            self.running -= 1
            self.finished.append(key)
        return f"executable {key}"


def compile_threads_alive():
    return [t for t in threading.enumerate() if t.name.startswith("jpaged-compile")]


def plan(runner, stop=None):
    return WarmUp(runner, runner.order(), runner.base_keys(), stop)


def test_compile_threads_default_and_knob(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert compile_threads("gpu") == compile_threads("cpu") == 1  # side by side only when asked for
    monkeypatch.setenv(THREADS_ENV, "3")
    assert compile_threads("gpu") == compile_threads("cpu") == 3
    for bad in ("0", "-1", "two", str(warmup.MAX_COMPILE_THREADS + 1)):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            compile_threads("cpu")


@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_compiles_keep_the_order_and_readiness(threads, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, str(threads))
    # The first bucket's forward (the full decode's) compiles longest: later keys finish before it.
    runner = FakeRunner(slow={("forward", 4): 0.4})
    order = runner.order()
    warm = plan(runner).start()
    assert warm.threads == threads
    seen = []  # ready_tokens as a serving thread sees them, with the executables there after
    while not warm.done.is_set():
        ready = list(warm.ready_tokens())
        seen.append((ready, set(runner._executables)))
        time.sleep(0.002)
    warm._thread.join(10)
    assert warm.ready and warm.compiled == warm.total == len(order)
    assert [key for key, _ in runner.lowered] == order  # lowered in order of need...
    assert {name for _, name in runner.lowered} == {"jpaged-warmup"}  # ... on the warm-up's own thread
    assert runner.started == order  # compiles taken in order of need
    assert runner.most_running == threads
    if threads > 1:
        assert runner.finished.index(("forward", 4)) > runner.finished.index(("forward", 1))
    previous = []
    for ready, have in seen:
        for tokens in ready:  # a ready bucket has every executable of its step
            assert all(k in have for k in step_keys(runner.buckets, runner.forward_keys, tokens)), (tokens, have)
        if ready:
            assert all(k in have for k in runner.base_keys())
        assert set(previous) <= set(ready), (previous, ready)  # readiness never goes back
        previous = ready
    assert warm.ready_tokens() == runner.buckets.tokens
    time.sleep(0.05)
    assert not compile_threads_alive()


def test_a_failed_compile_is_logged_and_its_buckets_left_out(monkeypatch, caplog):
    monkeypatch.setenv(THREADS_ENV, "3")
    monkeypatch.setenv(FAIL_ENV, "('sample', 4, True)")
    runner = FakeRunner(delay=0.01)
    with caplog.at_level(logging.ERROR, logger="jpaged.runner.warmup"):
        warm = plan(runner).start()
        assert warm.wait(30)
        warm._thread.join(10)
    failed = ("sample", 4, True)
    assert list(warm.failed) == [failed] and not warm.ready
    assert warm.compiled == warm.total - 1
    needing = [t for t in runner.buckets.tokens if failed in step_keys(runner.buckets, runner.forward_keys, t)]
    assert needing and warm.ready_tokens() == [t for t in runner.buckets.tokens if t not in needing]
    assert "compiling step shape ('sample', 4, True) failed" in caplog.text
    assert not compile_threads_alive()


def test_foreground_failure_raises_after_the_others(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "2")
    monkeypatch.setenv(FAIL_ENV, "('forward', 2)")
    runner = FakeRunner(delay=0.01)
    with pytest.raises(RuntimeError, match="injected compile failure"):
        plan(runner).run()
    assert len(runner._executables) == len(runner.order()) - 1
    assert not compile_threads_alive()


@pytest.mark.parametrize("background", [False, True])
def test_stop_ends_after_the_compiles_under_way(background, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "2")
    runner = FakeRunner(delay=0.2)
    stop = threading.Event()
    warm = plan(runner, stop)
    if background:
        warm.start()
    else:
        raised = []

        def foreground():
            try:
                warm.run()
            except SystemExit as e:
                raised.append(e.code)

        thread = threading.Thread(target=foreground, name="jpaged-foreground")
        thread.start()
    while len(runner.started) < 2:
        time.sleep(0.01)
    stop.set()
    (warm._thread if background else thread).join(10)
    time.sleep(0.3)  # (a compile that started after the stop would still be running)
    assert len(runner.started) <= 4, runner.started  # those under way, and at most one each taken meanwhile
    assert sorted(map(repr, runner.finished)) == sorted(map(repr, runner.started)) and runner.running == 0
    assert len(runner._executables) < len(runner.order())
    assert background or raised == [0]  # the server's start-up signal
    assert not compile_threads_alive()
