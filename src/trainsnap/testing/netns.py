"""Simulated nodes as Linux namespaces: each node its own network stack and its own memory tier.

:class:`Nodes` makes ``count`` nodes on one host. Node ``i`` is a network namespace joined to a
bridge by a veth pair, with its own address in a private test range (``10.213.<net>.<i+1>/24``,
``net`` drawn per instance: only addresses these tests created and remove are ever used), and a
mount namespace holding its own tmpfs at :attr:`Node.shm` for the memory tier. A holder process
keeps both namespaces alive; the node's processes join them (:meth:`Node.spawn`), so ranks of two
nodes reach each other only through the bridge, never through a shared loopback or ``/dev/shm``.
Paths outside :attr:`Node.shm` (a durable root) are the host's, shared by every node.

Failures: :meth:`Node.lose` kills every process of the node and its holder (its tmpfs goes with
its mount namespace: a lost node's memory is gone); :meth:`Node.cut_link` and
:meth:`Node.restore_link` take its veth down and up (a partition). :meth:`Nodes.replace` makes a
fresh node in a lost one's place. Leaving the context removes every namespace, link and bridge
made, also after a failure.

:func:`unavailable` says why namespaces cannot be made here (not root, no ``ip``/``unshare``/
``nsenter``, or the kernel refuses); tests skip with that reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from trainsnap.errors import TrainsnapError

_PREFIX = "10.213"
"""The private test range of the nodes' addresses (inside 10.0.0.0/8)."""
_HOLDER_WAIT_S = 10.0


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TrainsnapError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why simulated nodes cannot be made on this machine; None when they can."""
    if os.geteuid() != 0:
        return "not root (network and mount namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (apt-get install iproute2 util-linux)"
    probe = f"tsp{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except TrainsnapError as e:
        return f"the kernel refuses a network namespace: {e}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass
class Node:
    """One simulated node: a network namespace, its address, a mount namespace with a tmpfs."""

    index: int
    netns: str
    address: str
    veth_host: str
    veth_node: str
    shm: Path
    holder: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kw: object
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` inside this node's namespaces (``GLOO_SOCKET_IFNAME`` set to its link)."""
        if self.holder is None or self.holder.poll() is not None:
            raise TrainsnapError(f"node {self.index} is lost; replace it first")
        full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.veth_node}
        cmd = ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", *argv]
        proc = subprocess.Popen(cmd, env=full_env, **kw)  # type: ignore[call-overload]
        self.processes.append(proc)
        return proc  # type: ignore[no-any-return]

    def lose(self) -> None:
        """Kill every process of the node, then its holder: its tmpfs is gone."""
        for proc in [*self.processes, *([self.holder] if self.holder else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        self.processes.clear()
        self.holder = None

    def cut_link(self) -> None:
        _run("ip", "link", "set", self.veth_host, "down")

    def restore_link(self) -> None:
        _run("ip", "link", "set", self.veth_host, "up")


class Nodes:
    """``count`` simulated nodes on one bridge; a context manager that removes them."""

    def __init__(self, count: int, workdir: str | os.PathLike[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.net = int(self.tag, 16) % 250 + 1
        self.workdir = Path(workdir)
        self.bridge = f"tsb{self.tag}"
        self.count = count
        self.nodes: list[Node] = []
        self._made: list[tuple[str, ...]] = []

    def __enter__(self) -> Nodes:
        reason = unavailable()
        if reason is not None:
            raise TrainsnapError(f"cannot make simulated nodes: {reason}")
        try:
            self._make(
                ("ip", "link", "del", self.bridge),
                "ip",
                "link",
                "add",
                self.bridge,
                "type",
                "bridge",
            )
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(self.count):
                self.nodes.append(self._node(i, i))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for node in self.nodes:
            node.lose()
        for undo in reversed(self._made):
            subprocess.run(undo, capture_output=True, check=False)
        self._made.clear()

    def _make(self, undo: tuple[str, ...], *argv: str) -> None:
        _run(*argv)
        self._made.append(undo)

    def _node(self, index: int, host: int) -> Node:
        ns = f"ts{self.tag}n{index}h{host}"
        vh, vn = f"ts{self.tag}h{host}", f"ts{self.tag}n{host}"
        node = Node(index, ns, f"{_PREFIX}.{self.net}.{host + 1}", vh, vn, self.workdir / ns)
        self._make(("ip", "netns", "del", ns), "ip", "netns", "add", ns)
        self._make(
            ("ip", "link", "del", vh), "ip", "link", "add", vh, "type", "veth", "peer", "name", vn
        )
        _run("ip", "link", "set", vn, "netns", ns)
        _run("ip", "link", "set", vh, "master", self.bridge)
        _run("ip", "link", "set", vh, "up")
        inside = ("ip", "netns", "exec", ns)
        _run(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", vn)
        _run(*inside, "ip", "link", "set", vn, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        node.shm.mkdir(parents=True, exist_ok=True)
        script = f"mount -t tmpfs -o size=256m,mode=0700 tmpfs {node.shm} && exec sleep 1000000"
        node.holder = subprocess.Popen(
            [*inside, "unshare", "-m", "--propagation", "private", "sh", "-c", script]
        )
        deadline = time.monotonic() + _HOLDER_WAIT_S
        while not _has_tmpfs(node.holder.pid, node.shm):
            if node.holder.poll() is not None or time.monotonic() > deadline:
                raise TrainsnapError(f"node {index}'s namespaces did not come up")
            time.sleep(0.02)
        return node

    def replace(self, index: int) -> Node:
        """A fresh node (new namespaces, a new address, an empty tmpfs) in lost node
        ``index``'s place."""
        old = self.nodes[index]
        old.lose()
        host = max(int(n.address.rsplit(".", 1)[1]) for n in self.nodes)  # a new address
        self.nodes[index] = self._node(index, host)
        return self.nodes[index]


def _has_tmpfs(pid: int, path: Path) -> bool:
    """Whether process ``pid`` sees a tmpfs mounted at ``path``."""
    try:
        table = Path(f"/proc/{pid}/mounts").read_text()
    except OSError:
        return False
    return any(
        len(f := line.split()) > 2 and f[1] == str(path) and f[2] == "tmpfs"
        for line in table.splitlines()
    )
