"""Pacing: a sender spreads its datagrams at the link's rate, so a shaper's queue takes each
burst whole instead of dropping the tail of a tensor sent as fast as the socket takes it."""

from __future__ import annotations

# The default pacing burst: how late a wake-up can be and still be caught up (a busy host
# wakes a sleeper milliseconds late), at most BURST_FRAMES, which a shaper's queue (1000
# packets in htb's and netem's default) takes whole.
BURST_SECONDS = 0.02
BURST_FRAMES = 256
BATCH_SECONDS = 0.005  # a paced sender hands the kernel this much traffic per call


class TokenBucket:
    """Pacing: `rate` bits/s on average, at most `burst` bytes back to back. Sending more than
    the bucket holds puts it in debt; the caller waits the returned time off before sending."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"pacing: rate and burst must be positive, got {rate}, {burst}")
        self.rate = rate / 8
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def take(self, nbytes: int, now: float) -> float:
        """Spend `nbytes`; seconds to wait before sending them."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - nbytes
        self.stamp = now
        return max(0.0, -self.tokens / self.rate)


def paced(rate: float, burst: int | None, frame: int, now: float) -> tuple[TokenBucket, int]:
    """The bucket for `rate` bits/s of `frame`-byte Ethernet frames (`burst` bytes, or the
    default burst), and how many datagrams a paced sender hands the kernel per call."""
    burst = burst or max(4 * frame, min(int(rate / 8 * BURST_SECONDS), BURST_FRAMES * frame))
    batch = max(1, min(burst, int(rate / 8 * BATCH_SECONDS)) // frame)
    return TokenBucket(rate, burst, now), batch
