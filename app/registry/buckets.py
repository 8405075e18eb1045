"""Where each arm sits in the bucket space, so that a ramp keeps users in their arms.

Treatment arms take ranges from the top of the 10,000 buckets and grow downward, each in a
slot of its own (the whole space for one treatment, half of it each for two, ...); the
control holds the lowest buckets no treatment claims. Raising a treatment's weight
therefore only moves users from control into it, and no user leaves a treatment arm until
that arm's weight drops, which `ramp_experiment` allows only to 0 (the arm is stopped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.registry.audit import RegistryError

BUCKETS = 10_000
"""Buckets are basis points, like arm weights."""

Ranges = tuple[tuple[int, int], ...]
"""Half-open bucket ranges [low, high), ascending."""


@dataclass(frozen=True)
class ArmWeight:
    name: str
    weight_bps: int
    is_control: bool


def slot_size(arms: Sequence[ArmWeight]) -> int:
    """The most buckets one treatment arm may hold."""
    treatments = sum(not arm.is_control for arm in arms)
    return BUCKETS // max(treatments, 1)


def arm_ranges(arms: Sequence[ArmWeight]) -> dict[str, Ranges]:
    """Each arm's bucket ranges; buckets left over (weights under 10,000) are in no arm."""
    slot = slot_size(arms)
    ranges: dict[str, Ranges] = {}
    claimed: list[tuple[int, int]] = []
    treatments = [arm for arm in arms if not arm.is_control]
    for index, arm in enumerate(treatments):
        top = BUCKETS - index * slot
        low = max(top - min(arm.weight_bps, slot), 0)
        ranges[arm.name] = ((low, top),) if top > low else ()
        if top > low:
            claimed.append((low, top))
    for arm in arms:
        if arm.is_control:
            ranges[arm.name] = _lowest_free(sorted(claimed), arm.weight_bps)
    return ranges


def _lowest_free(claimed: list[tuple[int, int]], size: int) -> Ranges:
    """The lowest `size` buckets outside the claimed ranges."""
    free: list[tuple[int, int]] = []
    start = 0
    for low, high in [*claimed, (BUCKETS, BUCKETS)]:
        if size <= 0:
            break
        take = min(low - start, size)
        if take > 0:
            free.append((start, start + take))
            size -= take
        start = max(start, high)
    return tuple(free)


def check_layout(arms: Sequence[ArmWeight]) -> None:
    """Refuse a treatment weight larger than its slot: it would spill into another arm."""
    slot = slot_size(arms)
    for arm in arms:
        if not arm.is_control and arm.weight_bps > slot:
            raise RegistryError(
                422,
                "weight_exceeds_slot",
                f"Arm {arm.name!r}: weight {arm.weight_bps} exceeds {slot} basis points, the "
                f"most one of {BUCKETS // slot} treatment arms can hold.",
                param="weights",
            )


def check_ramp(before: dict[str, int], after: Sequence[ArmWeight]) -> None:
    """Refuse lowering a running treatment arm to a weight other than 0.

    Its users would move back to control mid-experiment and be counted in both arms; an arm
    set to 0 is stopped, and its users return to control with it.
    """
    for arm in after:
        old = before.get(arm.name, 0)
        if not arm.is_control and 0 < arm.weight_bps < old:
            raise RegistryError(
                409,
                "treatment_weight_lowered",
                f"Arm {arm.name!r}: a running treatment's weight can only grow ({old} -> "
                f"{arm.weight_bps} would move its users back to control); set it to 0 to stop "
                "the arm, or stop the experiment.",
                param="weights",
            )
