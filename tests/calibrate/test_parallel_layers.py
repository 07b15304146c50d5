"""The several-devices run's bookkeeping (quantmla.calibrate.parallel_layers): a process's error, or a process that
died without a word, stops the run with a message naming it instead of waiting for ever. (Its exports are compared
with the one-device run's in test_streamed.py.)"""

import queue
from types import SimpleNamespace

import pytest

from quantmla.calibrate import parallel_layers


class _Bar:
    def __init__(self):
        self.n = 0

    def update(self):
        self.n += 1


def test_a_layers_error_in_its_process_is_raised_with_its_traceback():
    done = queue.Queue()
    done.put((3, "Traceback (most recent call last):\nValueError: boom"))
    with pytest.raises(RuntimeError, match=r"(?s)calibrating layer 3 failed in its process:\n.*ValueError: boom"):
        parallel_layers._collect(done, [], {}, None, _Bar(), None, block=True)


def test_a_process_that_died_stops_the_wait():
    procs = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=-9)]
    with pytest.raises(RuntimeError, match=r"died \(exit code -9\)"):
        parallel_layers._collect(queue.Queue(), procs, {}, None, _Bar(), None, block=True)


def test_finished_layers_are_taken_without_waiting():
    done, results, bar, seen = queue.Queue(), {}, _Bar(), []
    for idx in (2, 0):
        done.put((idx, None))
    work = SimpleNamespace(load=lambda i: {"row": {"layer": i}})
    n = parallel_layers._collect(done, [], results, work, bar, seen.append, block=False)
    assert n == 2 and sorted(results) == [0, 2] and bar.n == 2 and seen == [2, 0]
    assert parallel_layers._collect(done, [], results, work, bar, None, block=False) == 0
