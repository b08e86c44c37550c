"""scripts/gpu-check run whole on the VM's cgroup v2 kernel, against a STAND-IN NVML (issue 36
item 10). Its first run on a real H100 failed by its own control flow: `kill && wait` under
`set -e` ended it with 143 before its fourth step, its readiness loop asked `gpus --socket`,
which answers from NVML without a daemon, and its EXIT trap's last command replaced the 0
after "OK".

No GPU here: gpucheck_standin/ makes pynvml answer as a fake DGX H100 (tests/unit/fake_nvml.py,
labelled) whose compute processes are those of a stand-in CUDA program (fake-torch), and a
stand-in nvidia-smi answers its --query-gpu from that same NVML. Real: the script, the CLI, the
daemon, `nodeagent exec --gpus 1` and the job's cgroup on this kernel, the freeze of the
violating workload's cgroup and its thaw, and /proc, from which each process's cgroup is read.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "gpucheck_standin"
SLICE = Path("/sys/fs/cgroup/nodeagent-gpucheck.slice")


def test_gpu_check_runs_its_six_steps_and_exits_0_after_ok(tmp_path: Path) -> None:
    processes = tmp_path / "processes"
    env = {
        **os.environ,
        "PYTHONPATH": str(STANDIN),
        "NODEAGENT_FAKE_NVML": str(processes),
        "TORCH_PYTHON": str(STANDIN / "fake-torch"),
        "PATH": f"{STANDIN}:{os.environ['PATH']}",  # its nvidia-smi
    }
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check")],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    print(done.stdout)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    steps = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert [s[:5] for s in steps] == ["== 1.", "== 2.", "== 3.", "== 4.", "== 5.", "== 6."], said
    assert "no violations\n" in done.stdout, said
    assert "8 GPUs: index, UUID, name, PCI bus id and memory agree\n" in done.stdout, said
    assert re.search(r"^frozen within \d+ s; killing pid \d+", done.stdout, re.M), said
    assert re.search(r"^thawed within \d+ s; its other process \(pid \d+\) runs on$", done.stdout,
                     re.M), said  # fmt: skip
    assert done.stdout.rstrip().endswith("an unheld one frozen, then thawed)"), said
    # the three stand-in CUDA processes ran (the second as the job exec started, the third
    # as the violator) and are gone
    pids = [int(line.split()[0]) for line in processes.read_text().splitlines()]
    assert len(pids) == 3, processes.read_text()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "left running"
    assert not SLICE.exists(), "its managed root is removed"
