"""tools/dma_probe.py's device time per call (``--spans``), on a synthetic trace (the tool
itself needs a GPU)."""
from tool_env import load_tool


def _trace(gaps):
    """Calls of a selection kernel (10 us), a memset (2 us) and an attention kernel (300 us);
    ``gaps[c]`` us of idle device before call c's first kernel; 1 us between the others."""
    events, t = [], 0.0
    for gap in gaps:
        t += gap
        for name, dur in (("select", 10.0), ("memset", 2.0), ("attention", 300.0)):
            events.append((name, t, t + dur))
            t += dur + 1.0
    return events


def test_spans_follow_the_longest_kernel_and_skip_the_first_call():
    spans_per_call = load_tool("dma_probe").spans_per_call
    # Back to back: 312 us of work and 3 us of gaps a call.
    span, busy = spans_per_call(_trace([50.0, 0.0, 0.0, 0.0, 0.0]))
    assert abs(span - 0.315) < 1e-9 and abs(busy - 0.312) < 1e-9
    # A host that fell behind before one of the four counted calls (the first two calls'
    # waits are not counted): the median span is a busy one, the busy time does not change.
    span, busy = spans_per_call(_trace([500.0, 200.0, 0.0, 200.0, 0.0, 0.0]))
    assert abs(span - 0.315) < 1e-9 and abs(busy - 0.312) < 1e-9
    # Behind before most counted calls: the median span shows the wait.
    span, _ = spans_per_call(_trace([0.0, 0.0, 200.0, 200.0, 0.0]))
    assert abs(span - 0.515) < 1e-9
    # Order of the events as given does not matter.
    assert spans_per_call(list(reversed(_trace([0.0] * 5)))) == spans_per_call(_trace([0.0] * 5))
