"""Simulated refits: model shapes, compact layout strings and whole worlds of rosters,
planned on one CPU without processes or GPUs (``torchrefit plan``)."""

from .meshes import Coords, Mesh, parse_mesh
from .rosters import SimulatedRosters, layout_of, simulated_rosters
from .shapes import PRESETS, GlobalTensor, ModelShape, global_tensors, held_tensors, preset

__all__ = ["ModelShape", "GlobalTensor", "PRESETS", "preset", "global_tensors", "held_tensors", "Mesh", "Coords",
           "parse_mesh", "SimulatedRosters", "simulated_rosters", "layout_of"]
