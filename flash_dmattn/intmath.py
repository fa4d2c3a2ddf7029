"""Host-side integer helpers for launch arithmetic.

``triton.cdiv`` / ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in recent Triton;
calling them from Python costs microseconds each, which adds up on a decode step whose GPU work
is a few microseconds. These plain versions are exact for the non-negative ints used here.
"""


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for ints (``-(-a // b)``)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n``, as ``triton.next_power_of_2`` (which gives 0 for 0)."""
    return max(int(n), 0) if n <= 1 else 1 << (int(n) - 1).bit_length()
