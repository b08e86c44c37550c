"""What the benchmarks measure the daemon against, and the unit tests check: `simulate`, an
offline fluid model of deadline jobs under the real policies (`scripts/bench deadline`), and
`placement_baselines`, the allocators placement is compared with (`scripts/bench gpu-alloc`).

Benchmark-only code, kept out of the installed package (issue 14, item 8): the wheel ships
`nodeagent*` only. The benchmarks import it as `benchref` (scripts/ is their sys.path[0]);
pytest has scripts/ on its path (`pythonpath` in pyproject.toml) and mypy gets it through
MYPYPATH (./scripts/test). Pure, as nodeagent/policy/ is: this folder's ruff.toml extends
that one's bans.
"""
