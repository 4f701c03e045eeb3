"""Many threads and faults against one compiled model and ``sparse_attention``: each call runs in its own thread's
``sparsity`` region, the records stay exact, and an error in the middle of a call (out of memory, an interrupt, a
kernel that fails to compile, a fork) leaves nothing half-updated."""

import contextlib
import os
import threading
import time

import pytest
import torch

import sparse_compile
from sparse_compile import breakeven, context, methods, padding
from sparse_compile.state import STATE
from helpers import SMALL_PBS, random_qkv
from state_bounds import cache_sizes

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = dict(SMALL_PBS, kernel="reference", planner="reference",
               sparge={"block_size_q": 16, "block_size_kv": 16}, bfla={"coarse_block_size": 32, "group_size": 8,
                                                                      "tile_size_q": 16, "tile_size_kv": 16})
# one region per thread: methods, densities, dense, and a min_seq_len that leaves these prompts dense
REGIONS = (
    dict(method="pbs", threshold=0.3),
    dict(method="pbs", threshold=0.95),
    dict(method="sparge", cdf_threshold=0.5),
    dict(method="sparge", cdf_threshold=0.95),
    dict(method="bfla", mass_threshold=0.5),
    dict(enabled=False),
    dict(min_seq_len=4096),
    dict(method="bfla", mass_threshold=0.9),
)
CALLS = 3  # per thread, each of the compiled model and sparse_attention
LENGTH = 80


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; and each test's threads are its own
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_compiled():
    """One compiled model for the module (compiling is most of each test's time); no compiled code carried in
    from other modules or out to them, as with ``fresh_compile_state``."""
    from models import ModelArgs, Transformer

    torch._dynamo.reset()
    model = Transformer(ModelArgs(vocab_size=32, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                  intermediate_size=32)).eval()
    yield torch.compile(model, backend="sparse_prefill", options=OPTIONS, dynamic=True)
    torch._dynamo.reset()


def _inputs(count):
    tokens = [torch.randint(0, 32, (2, LENGTH - i)) for i in range(count)]
    qkv = [random_qkv(2, 2, 1, LENGTH - i, LENGTH - i, 16) for i in range(count)]
    return tokens, qkv


def _calls(compiled, region, tokens, qkv, sparse_config):
    with torch.no_grad(), sparse_compile.sparsity(**region):
        return ([compiled(t) for t in tokens],
                [sparse_compile.sparse_attention(q, k, v, config=sparse_config) for q, k, v in qkv])


def _stats():
    return {site: dict(entry.calls) for site, entry in sparse_compile.runtime_stats().items()}


def test_eight_threads_each_in_its_own_region_match_the_same_calls_run_serially(monkeypatch, tiny_compiled):
    compiled = tiny_compiled
    sparse_config = sparse_compile.SparseConfig.from_options(OPTIONS)
    inputs = [_inputs(CALLS) for _ in REGIONS]
    # no lock of the package is held while a kernel runs (the serial pass: nothing else could hold one)
    executor_of, held = methods.executor_of, []

    def watched(config):
        run, params = executor_of(config)

        def run_watched(*args, **kwargs):
            held.append(any(lock.locked() for lock in STATE.locks()))
            return run(*args, **kwargs)
        return run_watched, params

    monkeypatch.setattr(methods, "executor_of", watched)
    with torch.no_grad():
        compiled(inputs[0][0][0])  # compiled before the threads start
    sparse_compile.reset_runtime_stats()
    serial = [_calls(compiled, region, *args, sparse_config) for region, args in zip(REGIONS, inputs)]
    serial_stats = _stats()
    assert held and not any(held)
    # the regions give different outputs: a call run in another thread's region would show
    assert len({round(float(out[1][0].sum()), 4) for out in serial}) >= 6

    sparse_compile.reset_runtime_stats()
    results, errors = [None] * len(REGIONS), []
    start = threading.Barrier(len(REGIONS))

    def worker(i):
        try:
            start.wait()
            results[i] = _calls(compiled, REGIONS[i], *inputs[i], sparse_config)
        except BaseException as exc:  # reported below, with the thread's region
            errors.append((REGIONS[i], exc))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(REGIONS))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "a thread is still running after 120 s: deadlock"
    assert not errors, errors
    for region, got, want in zip(REGIONS, results, serial):
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"region {region}")
    assert _stats() == serial_stats  # every call counted once, on its path, with its reason
    sparse = sum(n for calls in serial_stats.values() for (path, _), n in calls.items() if path == "sparse")
    assert sparse == 2 * CALLS * 6  # the six sparse regions, both entries
    assert context.current_region() == context.RegionState()


def _one_call_inputs():
    """Tokens for the compiled model, q, k, v for ``sparse_attention`` and its configuration: one call of each."""
    tokens = torch.randint(0, 32, (2, 64))
    return tokens, random_qkv(1, 2, 1, 64, 64, 16), sparse_compile.SparseConfig.from_options(OPTIONS)


def _fault(monkeypatch, error, times=1):
    """The plan's execution (the executor ``methods.executor_of`` gives: the kernel's stage) raises ``error`` on its
    next ``times`` calls, then runs again."""
    executor_of, left = methods.executor_of, [times]

    def failing(config):
        run, params = executor_of(config)

        def run_failing(*args, **kwargs):
            if left[0] > 0:
                left[0] -= 1
                raise error
            return run(*args, **kwargs)
        return run_failing, params

    monkeypatch.setattr(methods, "executor_of", failing)


def _nothing_half_updated(before):
    assert _stats() == before
    assert context.current_region() == context.RegionState()
    assert not padding.in_forward_scope()
    for name, (size, bound) in cache_sizes().items():
        assert size <= bound, name


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("out of memory: tried to allocate 2.00 GiB"),
                                   KeyboardInterrupt()], ids=["out_of_memory", "keyboard_interrupt"])
def test_an_error_inside_the_sparse_op_reaches_the_caller_and_the_next_call_succeeds(monkeypatch, error,
                                                                                     tiny_compiled):
    compiled = tiny_compiled
    tokens, (q, k, v), config = _one_call_inputs()
    with torch.no_grad():
        want_model, want_attention = compiled(tokens), sparse_compile.sparse_attention(q, k, v, config=config)
    before = _stats()
    for call in (lambda: compiled(tokens), lambda: sparse_compile.sparse_attention(q, k, v, config=config)):
        _fault(monkeypatch, error)
        with torch.no_grad(), pytest.raises(type(error)) as raised:
            with sparse_compile.sparsity(method="pbs", threshold=0.5):
                call()
        assert raised.value is error  # as raised: not wrapped, not turned into a dense call
        _nothing_half_updated(before)
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), want_model, rtol=0, atol=0)
        torch.testing.assert_close(sparse_compile.sparse_attention(q, k, v, config=config), want_attention,
                                   rtol=0, atol=0)
    after = _stats()
    assert sum(after["layers.0.attention"].values()) == 2 and sum(after["sparse_attention"].values()) == 2


def test_a_kernel_that_fails_to_compile_runs_the_call_dense_with_the_reason(monkeypatch, tiny_compiled):
    from triton.compiler.errors import CompilationError

    compiled = tiny_compiled
    tokens, (q, k, v), config = _one_call_inputs()
    with torch.no_grad(), sparse_compile.sparsity(enabled=False):
        dense_model = compiled(tokens)
        dense_attention = sparse_compile.sparse_attention(q, k, v, config=config)
    sparse_compile.reset_runtime_stats()
    _fault(monkeypatch, CompilationError(None, None, "out of resource: shared memory, required 262144"), times=2)
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), dense_model, rtol=0, atol=0)
        torch.testing.assert_close(sparse_compile.sparse_attention(q, k, v, config=config), dense_attention,
                                   rtol=0, atol=0)
        for site, calls in _stats().items():
            (path, reason), = calls
            assert path == "dense" and "failed to compile (CompilationError: out of resource: shared memory" in reason
        compiled(tokens)  # the next call compiles again, and runs sparse
    assert any(path == "sparse" for path, _ in _stats()["layers.0.attention"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_process_forked_after_the_first_call_works_even_with_a_lock_held_at_the_fork(tiny_compiled):
    compiled = tiny_compiled
    tokens, (q, k, v), config = _one_call_inputs()
    with torch.no_grad():
        want_model, want_attention = compiled(tokens), sparse_compile.sparse_attention(q, k, v, config=config)
    # as if another thread were recording a call at the moment of the fork: the child gets its own locks
    with contextlib.ExitStack() as held:
        for lock in STATE.locks():
            held.enter_context(lock)
        pid = os.fork()
    if pid == 0:  # the child: exit status 0 if its calls give the parent's results and are recorded
        status = 1
        try:
            with torch.no_grad():
                same = (torch.equal(compiled(tokens), want_model)
                        and torch.equal(sparse_compile.sparse_attention(q, k, v, config=config), want_attention))
            breakeven.HISTORY.record(("child",), torch.tensor(0.5), "16x16")
            status = 0 if same and sum(_stats()["sparse_attention"].values()) == 2 else 2
        finally:
            os._exit(status)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung (a lock held at the fork?)")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
