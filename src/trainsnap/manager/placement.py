"""Where a process's node is, and whether the memory tier can place the copies it promises.

One order of environment variables everywhere a tier needs this process's node
(:func:`node_from_environment`): ``GROUP_RANK`` (torchrun's node rank) first, then
``NODE_RANK`` (Lightning's and most launchers' name), then 0. The memory tier and the local tier
both read it.

A memory snapshot commits only once every object has ``1 + replicas`` copies on distinct nodes;
on fewer nodes than that the copies cannot be placed, and committing with fewer would break the
promise silently (:func:`check_copies` refuses unless the user opted in to fewer copies).
"""

from __future__ import annotations

import os

from trainsnap.errors import InvalidArgumentError

NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK")
"""The environment variables naming this process's node, in the order they are read."""


def node_from_environment(option: str) -> int:
    """This process's node from :data:`NODE_VARIABLES` (0 when none is set). ``option`` names
    the argument that overrides it, for the error of a value that is not a node number."""
    for var in NODE_VARIABLES:
        raw = os.environ.get(var)
        if raw is not None:
            try:
                node = int(raw)
            except ValueError:
                node = -1
            if node < 0:
                raise InvalidArgumentError(
                    f"environment variable {var}={raw!r} is not a node number; pass {option}"
                )
            return node
    return 0


def check_copies(nodes: int, replicas: int, *, allow_fewer_copies: bool) -> None:
    """Refuse a memory tier whose ``1 + replicas`` copies cannot go to distinct nodes among the
    job's ``nodes``, naming the fixes, unless ``allow_fewer_copies``. O(1)."""
    if allow_fewer_copies or 1 + replicas <= nodes:
        return
    raise InvalidArgumentError(
        f"MemoryTier(replicas={replicas}) promises {1 + replicas} copies of every object on "
        f"distinct nodes, but this job runs on {nodes} node(s): a node loss would lose the "
        f"memory tier. Run on at least {1 + replicas} nodes (each process's node comes from "
        "MemoryTier(node=), else GROUP_RANK, else NODE_RANK), set "
        f"MemoryTier(replicas={max(0, nodes - 1)}), or accept fewer copies with "
        "MemoryTier(allow_fewer_copies=True)."
    )
