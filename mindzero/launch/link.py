"""A shaped link for local launches (pure): the ranks run in a private network namespace whose loopback is
limited to a rate (and optionally delayed), so this machine can be put in the link-bound regime of an
accelerator cluster (docs/launch.md, "A shaped link").

[Note: the shaped-link model] One namespace is made per launch (:class:`LinkNamespace`: a holder process made by
``unshare -n`` that sleeps; every launcher command joins it with ``nsenter``). Its loopback is brought up and
given a root qdisc: ``tbf`` (token bucket) at the rate, or ``netem`` when a delay is asked (``netem`` may be
missing from a kernel: then a delay is refused, naming the qdisc). MindSpore's CPU collectives are TCP between
the ranks over that loopback, so:

* **one shared link**: every byte any rank sends crosses the one queue once, so ``rate`` is the *aggregate* of
  all ranks. A cluster whose N devices each have a link of B moves the same ring traffic in the same time
  when ``rate = N x B`` (a ring sends ``2 (N-1)/N x S`` per device for an all-reduce of S bytes; on the shared
  link the N devices' bytes queue one after another). `benchmarks/link_calibration.py` uses this;
* **the delay** is added to every packet, both ways (a round trip pays twice);
* **what it does not model**: separate per-node links and switches, intra-node links faster than inter-node
  ones, RDMA's lower CPU cost, and compute/communication overlap beyond what MindSpore's CPU runtime does. The
  CPU backend's emulations move bytes a real backend would not: a reduce-scatter is an all-reduce then a slice
  (``(N-1)/N x S`` more per device), hybrid groups are emulated over the whole world (docs/backends.md); the
  launch's byte counter (:meth:`LinkNamespace.counters`) counts what really crossed.

The machine's own loopback and network are untouched: only processes inside the namespace see the shaped one.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

# tc's rate units, in bit/s (tc(8): "bit", "kbit", ... are bits per second; "bps", "kbps", ... bytes per second)
_RATE_UNITS = {"bit": 1, "kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9,
               "bps": 8, "kbps": 8 * 10 ** 3, "mbps": 8 * 10 ** 6, "gbps": 8 * 10 ** 9}
_DELAY_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
# the loopback's MTU is 64 KiB: a token bucket smaller than one packet drops it, so the bucket holds at least two
_MIN_BURST = 2 * 65536
_READY = "mindzero-link-ready"


def parse_rate(text: str) -> int:
    """``"200mbit"`` -> 200_000_000 (bit/s): a number and one of tc's units (``bit``, ``kbit``, ``mbit``, ``gbit``;
    ``bps``, ``kbps``, ``mbps``, ``gbps`` for bytes per second)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"link rate {text!r}: must be a number and one of tc's units {sorted(_RATE_UNITS)}, "
                         "e.g. '200mbit'")
    bits = float(m.group(1)) * _RATE_UNITS[unit]
    if bits < 8000:
        raise ValueError(f"link rate {text!r}: must be at least 8kbit (1000 bytes per second)")
    return int(bits)


def parse_delay(text: str) -> float:
    """``"1ms"`` -> 1.0 (milliseconds): a number and ``us``, ``ms`` or ``s``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s)\s*", str(text))
    if not m:
        raise ValueError(f"link delay {text!r}: must be a number and one of ['ms', 's', 'us'], e.g. '1ms'")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2)]


@dataclass(frozen=True)
class LinkShape:
    """The shaped loopback of a launch: ``rate`` in bit/s (aggregate over all ranks: one shared link) and
    ``delay_ms`` added to every packet (0: none). Make it from strings with :meth:`parse`."""

    rate: int
    delay_ms: float = 0.0

    def __post_init__(self):
        if not isinstance(self.rate, int) or self.rate < 8000:
            raise ValueError(f"rate={self.rate!r}: must be an int of bit/s >= 8000")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms={self.delay_ms!r}: must be >= 0")

    @classmethod
    def parse(cls, rate: str, delay: Optional[str] = None) -> "LinkShape":
        return cls(parse_rate(rate), parse_delay(delay) if delay else 0.0)

    @property
    def bytes_per_second(self) -> float:
        return self.rate / 8

    def qdisc(self) -> list:
        """The ``tc qdisc add dev lo root ...`` arguments: ``tbf`` for a rate alone, ``netem`` with a delay. The
        bucket holds 10 ms of traffic and at least two 64 KiB packets; the queue may hold 1 s of traffic (TCP
        backs off before that, so nothing is dropped by design)."""
        if self.delay_ms:
            packets = max(1000, int(self.bytes_per_second * (1 + self.delay_ms / 1e3) / 1500))
            return ["netem", "delay", f"{self.delay_ms}ms", "rate", f"{self.rate}bit", "limit", str(packets)]
        burst = max(_MIN_BURST, int(self.bytes_per_second / 100))
        return ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "1s"]

    def describe(self) -> str:
        rate = (f"{self.rate / 1e9:g} Gbit/s" if self.rate >= 10 ** 9 else f"{self.rate / 1e6:g} Mbit/s"
                if self.rate >= 10 ** 6 else f"{self.rate / 1e3:g} kbit/s")
        return rate + (f", +{self.delay_ms:g} ms per packet" if self.delay_ms else "") + " (one shared loopback)"


class LinkUnavailable(RuntimeError):
    """This machine cannot make the shaped link: not Linux, a tool missing, namespaces not permitted, or the
    qdisc missing from the kernel. The message says which and what was tried."""


def _setup_script(shape: LinkShape) -> str:
    qdisc = " ".join(shape.qdisc())
    return f"ip link set lo up && tc qdisc add dev lo root {qdisc} && echo {_READY} && exec sleep 2147483647"


def _unshare_flags() -> list:
    """``-n`` as root; an unprivileged user also needs a user namespace (``-r``: mapped to root inside it)."""
    return ["-n"] if os.geteuid() == 0 else ["-r", "-n"]


def check_link_support(shape: Optional[LinkShape] = None) -> None:
    """Raise :class:`LinkUnavailable` unless a namespace with ``shape``'s qdisc can be made here (tried for real:
    a throwaway namespace is made and dropped)."""
    if not sys.platform.startswith("linux"):
        raise LinkUnavailable(f"a shaped link needs Linux network namespaces; this is {sys.platform}")
    missing = [tool for tool in ("unshare", "nsenter", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(f"a shaped link needs {missing} on PATH (util-linux and iproute2)")
    shape = shape or LinkShape(10 ** 9)
    script = _setup_script(shape).replace("exec sleep 2147483647", "true")
    cmd = ["unshare", *_unshare_flags(), "sh", "-c", script]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        why = res.stderr.strip() or res.stdout.strip()
        hint = (f"the kernel has no '{shape.qdisc()[0]}' qdisc (a delay needs sch_netem; a rate alone uses tbf)"
                if "qdisc kind is unknown" in why else
                "network namespaces are not permitted here (a container without CAP_SYS_ADMIN, or "
                "unprivileged user namespaces disabled)")
        raise LinkUnavailable(f"cannot make a shaped link: {hint}; `{' '.join(cmd)}` said: {why}")


class LinkNamespace:
    """A private network namespace with a shaped loopback, alive until :meth:`close`: :meth:`wrap` makes a
    command run inside it; :meth:`counters` reads the bytes and packets its loopback carried."""

    def __init__(self, shape: LinkShape):
        self.shape = shape
        self.userns = os.geteuid() != 0
        self.holder = subprocess.Popen(["unshare", *_unshare_flags(), "sh", "-c", _setup_script(shape)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
        line = self.holder.stdout.readline().strip()  # the setup's echo, or "" when it failed and exited
        if line != _READY:
            err = self.holder.stderr.read() if self.holder.poll() is not None else ""
            self.close()
            raise LinkUnavailable(f"the shaped link's namespace did not start ({err.strip() or line!r}); "
                                  "check_link_support() says why")

    def wrap(self, cmd: list) -> list:
        """``cmd`` run inside the namespace (``nsenter`` execs it: the same process, the same pid)."""
        user = ["-U", "--preserve-credentials"] if self.userns else []
        return ["nsenter", "-t", str(self.holder.pid), *user, "-n", "--", *cmd]

    def counters(self) -> dict:
        """``{"bytes": ..., "packets": ...}`` the namespace's loopback sent so far (``/proc/<pid>/net/dev`` of
        the holder: its namespace's devices)."""
        with open(f"/proc/{self.holder.pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    fields = rest.split()
                    return {"bytes": int(fields[8]), "packets": int(fields[9])}  # transmit bytes, packets
        raise LinkUnavailable("the shaped link's namespace has no loopback")

    def close(self) -> None:
        if self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
        self.holder.wait()
        for stream in (self.holder.stdout, self.holder.stderr):
            stream.close()
