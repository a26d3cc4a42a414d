"""Unit tests of model_repository/code2wav/1/code2wav_calls.py (no server): code2wav's decoder calls
block their threads, and their results reach the event loop in bursts."""

import asyncio
import gc
import threading
import weakref

import pytest

from helpers import MODEL_REPOSITORY, load_model_module, wait_until

code2wav_calls = load_model_module(MODEL_REPOSITORY / "code2wav" / "1" / "code2wav_calls.py")


def test_each_result_and_exception_reaches_its_own_future_and_nothing_stays_on_the_threads():
    """An idle thread that kept a BLS request or response would free it after the stub unmapped its memory."""
    with pytest.raises(ValueError, match="max_threads must be >= 1, got 0"):
        code2wav_calls.BlockingCalls(0)
    calls, seen = code2wav_calls.BlockingCalls(4), {}

    def failing():
        raise ValueError("decoder gone")

    class Held:  # stands in for the BLS request (its bound exec is the call) and its response
        def exec(self):
            return self.answer

    async def main():
        loop = asyncio.get_running_loop()
        futures = [calls.call(loop, lambda value=value: value * value) for value in range(12)]
        failed = calls.call(loop, failing)
        results = await asyncio.gather(*futures)
        with pytest.raises(ValueError, match="decoder gone"):
            await failed
        request, request.answer = Held(), Held()
        seen["request"], seen["response"] = weakref.ref(request), weakref.ref(request.answer)
        assert await calls.call(loop, request.exec) is seen["response"]()
        del request
        return results

    assert asyncio.run(main()) == [value * value for value in range(12)]
    gc.collect()
    assert calls._threads and all(thread.is_alive() for thread in calls._threads)  # idle, waiting for calls
    assert seen["request"]() is None and seen["response"]() is None
    calls.close()


def test_results_that_arrive_while_the_loop_is_busy_wake_it_once():
    calls = code2wav_calls.BlockingCalls(16)
    runs, hand_over = [], calls._hand_over  # count the hand-overs the threads schedule
    calls._hand_over = lambda: (runs.append(1), hand_over())
    release, blocked = threading.Event(), threading.Semaphore(0)

    def blocking(index):
        blocked.release()
        release.wait(10)
        return index

    async def main():
        loop = asyncio.get_running_loop()
        futures = [calls.call(loop, lambda index=index: blocking(index)) for index in range(10)]
        for _ in range(10):  # every call is blocked in its thread
            assert blocked.acquire(timeout=10)
        release.set()
        assert wait_until(lambda: len(calls._results) == 10, 10, poll_s=0.001)  # the loop blocked until all are in
        return await asyncio.gather(*futures)

    assert asyncio.run(main()) == list(range(10))
    assert len(runs) == 1, f"{len(runs)} hand-overs for ten results that arrived together"
    calls.close()


def test_threads_start_as_calls_need_them_up_to_the_cap_and_close_stops_them():
    """close() waits for the threads to end and names those still blocked in a call, whose call still finishes."""
    calls, three_at_once = code2wav_calls.BlockingCalls(3), threading.Barrier(3)
    started, release, blocked_in = threading.Event(), threading.Event(), []

    def blocked_call():
        blocked_in.append(threading.current_thread().name)
        started.set()
        return release.wait(10)

    async def main():
        loop = asyncio.get_running_loop()
        for _ in range(4):  # one call at a time: one thread is enough
            assert await calls.call(loop, lambda: True)
        assert len(calls._threads) == 1
        # Each of nine calls returns once three of them run at once (a barrier that breaks after 5 s otherwise).
        await asyncio.gather(*(calls.call(loop, lambda: three_at_once.wait(5)) for _ in range(9)))
        assert len(calls._threads) == 3
        blocked = calls.call(loop, blocked_call)
        assert started.wait(10)
        assert calls.close(timeout_s=0.2) == blocked_in  # the thread blocked in it, by name:
        assert blocked_in[0] in [f"code2wav-bls-{index}" for index in range(3)]
        release.set()
        assert await blocked is True  # the call still finishes, then its thread ends

    asyncio.run(main())
    threads = list(calls._threads)
    assert calls.close() == []  # returns once they have ended
    assert not any(thread.is_alive() for thread in threads)
