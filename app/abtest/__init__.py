"""A/B measurement without a web framework: rollups, per-arm reads, statistics, guardrails.

Analytics' routes, the workers' guardrail timer and the demo all read results through it.
"""
