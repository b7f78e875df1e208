"""The differentiation engine and the passes that clean up what it emits."""

from onnx_autodiff.passes.autodiff import AutodiffPass, AutodiffResult, autodiff_pass
from onnx_autodiff.passes.cleanup import CleanupPass, CleanupResult, cleanup_passes
from onnx_autodiff.passes.functions import gradient_of_function, gradient_of_nodes
from onnx_autodiff.passes.gradient_op import GradientOpLoweringPass
from onnx_autodiff.passes.outline import OutlinePass

__all__ = [
    "AutodiffPass",
    "AutodiffResult",
    "CleanupPass",
    "CleanupResult",
    "GradientOpLoweringPass",
    "OutlinePass",
    "autodiff_pass",
    "cleanup_passes",
    "gradient_of_function",
    "gradient_of_nodes",
]
