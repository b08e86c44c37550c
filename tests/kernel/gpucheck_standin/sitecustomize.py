"""STAND-IN NVML for scripts/gpu-check's test (tests/kernel/test_gpu_check.py).

Python imports this module at the start of every interpreter whose path holds this
directory (the test puts it on PYTHONPATH, which gpu-check passes on to each `nodeagent`
it runs). Only when NODEAGENT_FAKE_NVML names a file does it do anything: then pynvml
answers as tests/unit/fake_nvml.py's labelled fake DGX H100, and its compute processes are
those the stand-in CUDA program (`fake-torch`, beside this file) wrote to that file, one
line each, `PID VISIBLE` (VISIBLE: the GPU's index or UUID, as CUDA_VISIBLE_DEVICES named
it), while the process lives. Nothing else changes.
"""

from __future__ import annotations

import os

if os.environ.get("NODEAGENT_FAKE_NVML"):
    import importlib
    import sys
    from pathlib import Path
    from types import SimpleNamespace
    from typing import Any

    import pynvml

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit"))
    fake_nvml: Any = importlib.import_module("fake_nvml")  # tests/unit's, not on mypy's path
    NO_INSTANCE = 0xFFFFFFFF  # NVML's gpuInstanceId for a process on a whole GPU
    _fake = fake_nvml.FakeNvml(fake_nvml.dgx_h100())

    def _registered(h: Any, name: str) -> list[SimpleNamespace]:
        """The GPU's compute processes: those written to the file that still live."""
        gpu = _fake._gpu(h, name)
        listed = Path(os.environ["NODEAGENT_FAKE_NVML"])
        out = []
        for line in listed.read_text().splitlines() if listed.exists() else ():
            pid, visible = line.split()
            if visible in (str(h.gpu), gpu.uuid) and Path(f"/proc/{pid}").exists():
                out.append(SimpleNamespace(pid=int(pid), usedGpuMemory=256 * fake_nvml.MIB,
                                           gpuInstanceId=NO_INSTANCE,
                                           computeInstanceId=NO_INSTANCE))  # fmt: skip
        return out

    _fake._processes = _registered
    for _name in dir(_fake):
        if _name.startswith("nvml"):
            setattr(pynvml, _name, getattr(_fake, _name))
