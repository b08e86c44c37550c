"""GPUs: what the node has (NVML, or a simulated node from YAML), and how GPUs connect.

`model` holds the frozen descriptions every part shares, `backend` the one interface
(a leaf), `choice` the choice between NVML and a simulation, `nvml` the only code that
talks to NVML, `simulated` the YAML node descriptions in config/gpus/. Placement is pure and
lives in nodeagent/gpualloc/placement/.
"""
