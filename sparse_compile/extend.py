"""The extension API: define and register a sparse method, its parameter classes, block plans, and the types
``calibrate()`` and ``explain()`` return. The user API (compile, regions, calls, reports) is ``sparse_compile``.

    from sparse_compile.extend import DensityKnob, Method, MethodParams, register_method
    register_method(Method(name="window", params=WindowParams, select=select, density=DensityKnob(...)))

A method is two files and this one line (docs/design.md, "Adding a method"); tests/window_method.py is one.
``reset_state()`` empties every store the package keeps across calls (``sparse_compile.state.STATE``), as a fresh
import has them: what a test calls to start clean.
"""

from .calibrate import Calibration, SiteCalibration
from .explain import ExplainReport
from .methods import build_plan
from .methods.bfla import BFLAParams
from .methods.pbs import PBSParams
from .methods.s2o import S2OParams
from .methods.sampled import SampledParams
from .methods.sparge import SpargeParams
from .params import MethodParams
from .plan import BlockPlan, execute_plan
from .registry import DensityKnob, Method, register_method
from .state import STATE

reset_state = STATE.reset

__all__ = [
    "register_method",
    "Method",
    "DensityKnob",
    "MethodParams",
    "PBSParams",
    "SpargeParams",
    "BFLAParams",
    "S2OParams",
    "SampledParams",
    "build_plan",
    "BlockPlan",
    "execute_plan",
    "Calibration",
    "SiteCalibration",
    "ExplainReport",
    "reset_state",
]
