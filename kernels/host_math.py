"""Launch arithmetic on the host in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr functions
whose host calls cost ~3 us each (a step's split planning made hundreds of them)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
