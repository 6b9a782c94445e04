"""Compute threads (SYSTEM §5.7): how many, and setting them for the kernels."""
from __future__ import annotations

import os

from . import kernels as K


def physical_cores() -> int:
    """Physical cores (SYSTEM §5.7): CPUs that are the first of their sibling list."""
    logical = os.cpu_count() or 1
    try:
        base = "/sys/devices/system/cpu"
        firsts = set()
        for name in os.listdir(base):
            if name.startswith("cpu") and name[3:].isdigit():
                with open(f"{base}/{name}/topology/thread_siblings_list") as f:
                    firsts.add(f.read().strip().replace("-", ",").split(",")[0])
        if firsts:
            return min(len(firsts), logical)
    except OSError:
        pass
    return logical


def default_threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return physical_cores()



def set_threads(n: int) -> None:
    K.set_num_threads(n)
