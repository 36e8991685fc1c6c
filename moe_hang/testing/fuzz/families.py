"""The job shapes a fault is planted in, by name: data parallel (:mod:`.fam_data`), FSDP2
(:mod:`.fam_fsdp`), tensor and pipeline parallel (:mod:`.fam_mesh`), each built from
:mod:`.sites` records and put in a step layout of :mod:`.shapes`."""

from __future__ import annotations

from collections.abc import Callable

from moe_hang.testing.fuzz.fam_data import ddp, plain
from moe_hang.testing.fuzz.fam_fsdp import EXPERTS, fsdp2, fsdp2_moe
from moe_hang.testing.fuzz.fam_mesh import dtensor, mesh2d, p2p
from moe_hang.testing.fuzz.shapes import reshape
from moe_hang.testing.fuzz.sites import Family, Site

FAMILIES = ("plain", "ddp", "fsdp2", "fsdp2_moe", "dtensor", "mesh2d", "p2p")

__all__ = ["EXPERTS", "FAMILIES", "Family", "Site", "build", "worlds"]


def worlds(name: str) -> tuple[int, ...]:
    """World sizes a family is generated with (a 2-D mesh needs an even world of 4 or more)."""
    return (4, 6, 8) if name == "mesh2d" else (2, 3, 4, 6, 8)


def build(name: str, world: int, mesh: tuple[int, int] | None = None,
          shape: str = "plain") -> Family:
    """Family ``name`` on ``world`` ranks (a 2-D mesh: ``mesh``), its step in layout
    ``shape``."""
    if name == "mesh2d":
        if mesh is None or mesh[0] * mesh[1] != world:
            raise ValueError(f"mesh2d on {world} ranks needs a mesh of {world}")
        return reshape(mesh2d(world, mesh), shape)
    makers: dict[str, Callable[[int], Family]] = {
        "plain": plain, "ddp": ddp, "fsdp2": fsdp2, "fsdp2_moe": fsdp2_moe,
        "dtensor": dtensor, "p2p": p2p}
    if name not in makers:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return reshape(makers[name](world), shape)
