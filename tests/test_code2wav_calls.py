"""Unit tests of model_repository/code2wav/1/code2wav_calls.py (no server): code2wav's decoder calls
block their threads, and their results reach the event loop in bursts."""

import asyncio
import gc
import threading
import time
import weakref

import pytest

from helpers import MODEL_REPOSITORY, load_model_module

code2wav_calls = load_model_module(MODEL_REPOSITORY / "code2wav" / "1" / "code2wav_calls.py")


def counting_hand_overs(calls) -> list:
    """Replace the instance's hand-over with one that counts its runs (the threads schedule it)."""
    runs, hand_over = [], calls._hand_over

    def counted():
        runs.append(1)
        hand_over()

    calls._hand_over = counted
    return runs


def test_each_result_and_exception_reaches_its_own_future():
    calls = code2wav_calls.BlockingCalls(4)

    def failing():
        raise ValueError("decoder gone")

    async def main():
        loop = asyncio.get_running_loop()
        futures = [calls.call(loop, lambda value=value: value * value) for value in range(12)]
        failed = calls.call(loop, failing)
        results = await asyncio.gather(*futures)
        with pytest.raises(ValueError, match="decoder gone"):
            await failed
        return results

    assert asyncio.run(main()) == [value * value for value in range(12)]
    calls.close()


def test_results_that_arrive_while_the_loop_is_busy_wake_it_once():
    calls = code2wav_calls.BlockingCalls(16)
    runs = counting_hand_overs(calls)
    release = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        futures = [calls.call(loop, lambda index=index: release.wait(5) and index) for index in range(10)]
        await asyncio.sleep(0.05)  # every call is blocked in its thread
        release.set()
        time.sleep(0.3)  # the loop is busy while all ten results arrive
        return await asyncio.gather(*futures)

    assert asyncio.run(main()) == list(range(10))
    assert len(runs) == 1, f"{len(runs)} hand-overs for ten results that arrived together"
    calls.close()


def test_threads_start_as_calls_need_them_up_to_the_cap():
    calls = code2wav_calls.BlockingCalls(3)
    running, most, lock = [0], [0], threading.Lock()

    def blocking():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return True

    async def main():
        loop = asyncio.get_running_loop()
        for _ in range(4):  # one call at a time: one thread is enough
            assert await calls.call(loop, blocking)
        assert calls.threads == 1
        return await asyncio.gather(*(calls.call(loop, blocking) for _ in range(10)))

    assert all(asyncio.run(main()))
    assert calls.threads == 3 and most[0] == 3, (calls.threads, most[0])
    calls.close()


def test_close_stops_every_thread():
    calls = code2wav_calls.BlockingCalls(4)

    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(calls.call(loop, lambda: time.sleep(0.02)) for _ in range(4)))

    asyncio.run(main())
    threads = list(calls._threads)
    assert len(threads) == 4
    assert calls.close() == []  # returns once they have ended
    assert not any(thread.is_alive() for thread in threads)


def test_close_names_a_thread_still_blocked_in_its_call():
    calls = code2wav_calls.BlockingCalls(2)
    release = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        await calls.call(loop, lambda: None)
        blocked = calls.call(loop, release.wait)
        assert calls.close(timeout_s=0.2) == ["code2wav-bls-0"]
        release.set()
        assert await blocked is True  # the call still finishes, then its thread ends

    asyncio.run(main())
    assert calls.close() == []


def test_a_finished_call_leaves_nothing_on_its_thread():
    """A BLS request and its response hold the Python backend's shared memory: an idle thread that
    kept the last ones would free them when it ends, after the stub has unmapped that memory."""
    calls = code2wav_calls.BlockingCalls(1)

    class Held:  # stands in for the BLS request (its bound exec is the call) and its response
        def __init__(self, answer=None):
            self.answer = answer

        def exec(self):
            return self.answer

    seen = {}

    async def main():
        loop = asyncio.get_running_loop()
        response = Held()
        request = Held(response)
        seen["request"], seen["response"] = weakref.ref(request), weakref.ref(response)
        assert await calls.call(loop, request.exec) is response
        del request, response

    asyncio.run(main())
    gc.collect()
    assert calls.threads == 1 and calls._threads[0].is_alive()  # idle, waiting for the next call
    assert seen["request"]() is None and seen["response"]() is None
    calls.close()


def test_at_least_one_thread():
    with pytest.raises(ValueError, match="max_threads must be >= 1, got 0"):
        code2wav_calls.BlockingCalls(0)
