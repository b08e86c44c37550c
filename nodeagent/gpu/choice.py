"""Where a node's GPUs come from: NVML on a real host, or a YAML node description
(config/gpus/) when one is named, for tests, demos and benchmarks on machines without GPUs.

Apart from `backend` (the interface), so that the interface is a leaf: the backends import it,
and only this module imports the backends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from nodeagent.gpu.backend import GpuBackend

SIM_ENV = "NODEAGENT_GPU_SIM"
"""Names a simulated node description when no file is given explicitly."""


def open_backend(
    simulate: str | None = None,
    proc_root: str = "/proc",
    environ: Mapping[str, str] = os.environ,
) -> GpuBackend:
    """The simulated node in `simulate`, else the one NODEAGENT_GPU_SIM names, else NVML.

    A bad simulation file raises PolicyError (FILE:LINE:COL for each problem): someone
    asked for it by name. A host without NVML gets NoGpus, never an exception.
    """
    # Imported here: only the chosen backend is loaded (NVML's bindings, or the YAML loader).
    path = simulate or environ.get(SIM_ENV) or None
    if path:
        from nodeagent.gpu.simulated import load_simulated  # noqa: PLC0415

        return load_simulated(path, proc_root=proc_root)
    from nodeagent.gpu.nvml import open_nvml  # noqa: PLC0415

    return open_nvml(proc_root=proc_root)
