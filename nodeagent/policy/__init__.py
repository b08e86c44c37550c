"""Pure decision-making: classify workloads, age usage history, run policies, build a plan.

Nothing in this package does I/O or reads a clock; ruff's banned-api rules in
this folder's ruff.toml enforce it, so a policy can be tested from a snapshot alone.
"""
