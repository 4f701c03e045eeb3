"""sparse_compile: a torch.compile backend that runs causal prefill attention through sparse Triton kernels.

    model = torch.compile(model, backend="sparse_prefill", options={"method": "pbs"})
    with sparse_compile.sparsity(method="bfla"):
        logits = model(input_ids)
    print(sparse_compile.explain(model, input_ids))
    calibration = sparse_compile.calibrate(model, input_ids, method="pbs", target_error=0.02)
"""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path


def _map_source_tree_kernels() -> None:
    """Run from a source checkout (``PYTHONPATH=.``, or a clone beside another editable install), map this tree's
    top-level ``kernels/`` folder to ``sparse_compile.kernels``, as installing the package does."""
    root = _Path(__file__).resolve().parent.parent
    folder = root / "kernels"
    if not ((root / "pyproject.toml").is_file() and (folder / "__init__.py").is_file()):
        return  # an installed package: its own mapping holds
    spec = _importlib_util.find_spec(__name__ + ".kernels")
    if spec is not None and spec.origin and _Path(spec.origin).resolve().parent == folder:
        return
    spec = _importlib_util.spec_from_file_location(
        __name__ + ".kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = _importlib_util.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_map_source_tree_kernels()

from .methods import build_plan  # noqa: E402  (first: the built-in methods register themselves)
from .methods.bfla import BFLAParams  # noqa: E402
from .methods.pbs import PBSParams  # noqa: E402
from .methods.s2o import S2OParams  # noqa: E402
from .methods.sampled import SampledParams  # noqa: E402
from .methods.sparge import SpargeParams  # noqa: E402
from .backend import sparse_prefill  # noqa: E402
from .config import MethodParams, SparseConfig  # noqa: E402
from .context import sparsity  # noqa: E402
from .calibrate import Calibration, SiteCalibration, calibrate  # noqa: E402
from .explain import ExplainReport, explain  # noqa: E402
from .api import precompile, sparse_attention  # noqa: E402
from .plan import BlockPlan, execute_plan  # noqa: E402
from .registry import DensityKnob, Method, register_method  # noqa: E402
from .parallel import sequence_parallel, ulysses_attention  # noqa: E402
from .report import reset_runtime_stats, runtime_stats  # noqa: E402
from .transformers_attention import enable_transformers_attention, register as _register  # noqa: E402

_register()  # the "sparse_prefill" attention implementation, where transformers is imported already

__all__ = [
    "SparseConfig",
    "PBSParams",
    "SpargeParams",
    "BFLAParams",
    "S2OParams",
    "SampledParams",
    "MethodParams",
    "Method",
    "DensityKnob",
    "register_method",
    "build_plan",
    "BlockPlan",
    "execute_plan",
    "sparse_prefill",
    "sparsity",
    "calibrate",
    "Calibration",
    "SiteCalibration",
    "explain",
    "ExplainReport",
    "sparse_attention",
    "precompile",
    "sequence_parallel",
    "ulysses_attention",
    "runtime_stats",
    "reset_runtime_stats",
    "enable_transformers_attention",
]

__version__ = "0.1.0"
