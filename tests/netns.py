"""Test hosts in Linux network namespaces, joined by veth links (made and removed by the test).

Topology of :func:`gate_d_hosts`::

    net A 10.R.1.0/24 (bridge in ns "sw"):  head 10.R.1.10   mid 10.R.1.11   relay 10.R.1.1
    net B 10.R.2.0/24 (one veth link):      nat  10.R.2.10 ---------------- relay 10.R.2.1

The relay host does not forward between its two networks, so the "nat" host reaches
only the relay, and no other host can reach it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import attrs


def unavailable_reason() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"nrprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@attrs.frozen
class Hosts:
    """Namespace names and addresses of the test hosts."""

    ns: dict[str, str]
    addr: dict[str, str]

    def prefix(self, host: str) -> list[str]:
        """Command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.ns[host]]


@contextmanager
def gate_d_hosts() -> Iterator[Hosts]:
    """Create the topology above; remove it on exit, whatever happened."""
    tag = f"nr{os.getpid() % 10000}{random.randrange(100)}"
    subnet = random.randrange(100, 250)
    names = {h: f"{tag}{h}" for h in ("sw", "head", "mid", "nat", "relay")}
    addr = {
        "head": f"10.{subnet}.1.10",
        "mid": f"10.{subnet}.1.11",
        "relay_a": f"10.{subnet}.1.1",
        "nat": f"10.{subnet}.2.10",
        "relay_b": f"10.{subnet}.2.1",
    }
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        sw = names["sw"]
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for host, ip_addr in (("head", addr["head"]), ("mid", addr["mid"]), ("relay", addr["relay_a"])):
            ns = names[host]
            _ip(
                "link",
                "add",
                f"{tag}{host}a",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"{tag}{host}s",
                "netns",
                sw,
            )
            _ip("-n", ns, "addr", "add", f"{ip_addr}/24", "dev", f"{tag}{host}a")
            _ip("-n", ns, "link", "set", f"{tag}{host}a", "up")
            _ip("-n", sw, "link", "set", f"{tag}{host}s", "master", "br0")
            _ip("-n", sw, "link", "set", f"{tag}{host}s", "up")
        _ip(
            "link",
            "add",
            f"{tag}natb",
            "netns",
            names["nat"],
            "type",
            "veth",
            "peer",
            "name",
            f"{tag}rlyb",
            "netns",
            names["relay"],
        )
        _ip("-n", names["nat"], "addr", "add", f"{addr['nat']}/24", "dev", f"{tag}natb")
        _ip("-n", names["nat"], "link", "set", f"{tag}natb", "up")
        _ip("-n", names["relay"], "addr", "add", f"{addr['relay_b']}/24", "dev", f"{tag}rlyb")
        _ip("-n", names["relay"], "link", "set", f"{tag}rlyb", "up")
        yield Hosts(names, addr)
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def reachable(hosts: Hosts, source: str, target_ip: str) -> bool:
    """Whether ``source`` can open a TCP connection toward ``target_ip`` (a refused port counts as reachable)."""
    probe = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(1)\n"
        "try:\n s.connect((sys.argv[1], 9)); print('up')\n"
        "except ConnectionRefusedError: print('up')\n"
        "except OSError: print('down')\n"
    )
    out = subprocess.run([*hosts.prefix(source), "python3", "-c", probe, target_ip], capture_output=True, text=True)
    return out.stdout.strip() == "up"
