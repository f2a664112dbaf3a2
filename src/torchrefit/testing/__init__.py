"""Tools for testing refits: a multi-process world on CPU and Megatron-like toy models.

Used by torchrefit's own tests, by ``torchrefit demo`` and by the benchmarks; users
can use them to test their own refits the same way.
"""

from ..simulate.meshes import Coords, Mesh
from .cases import run_cases
from .failures import attempt_refit, check_failed_everywhere
from .processes import WorldError, run_world
from .toy import ModelSpec, build_toy, expected_local, global_value, load_seed
from .transports import usable_transports

__all__ = ["run_world", "run_cases", "WorldError", "Mesh", "Coords", "ModelSpec", "build_toy",
           "expected_local", "global_value", "load_seed", "attempt_refit", "check_failed_everywhere",
           "usable_transports"]
