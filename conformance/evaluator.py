"""Running a model: onnxruntime (single-threaded, CPU) or onnx's reference evaluator with float64
kernels, first that loads; inputs copied before every run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx


class Evaluator:
    """Runs a model on onnxruntime (single-threaded), falling back to onnx's reference evaluator.

    ``prefer="onnxruntime"`` tries onnxruntime then the reference evaluator; ``"reference"`` uses
    the reference evaluator only; ``backends=(...)`` gives the order explicitly. The reference
    evaluator runs with the float64 kernels of :mod:`onnx_autodiff.conformance.kernels`.
    ``backend`` names the one in use; construction raises RuntimeError if none loads. A model
    with a seeded random op runs in a new onnxruntime session per call (same draws).
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        prefer: str = "onnxruntime",
        backends: Sequence[str] | None = None,
    ) -> None:
        self.model = model
        self.backend = None
        self._run = None
        errors = []
        if backends is None:
            backends = ("onnxruntime", "reference") if prefer == "onnxruntime" else ("reference",)
        for backend in backends:
            try:
                self._run = getattr(self, f"_make_{backend}")()
                self.backend = backend
                break
            except Exception as error:  # noqa: BLE001 - any failure means: try the next backend
                errors.append(f"{backend}: {first_line(error)}")
        if self._run is None:
            raise RuntimeError("no backend runs the model: " + "; ".join(errors))

    def _make_onnxruntime(self):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        serialized = self.model.SerializeToString()
        session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
        if _seeded(self.model):
            # a seeded random op (training Dropout) repeats its draws in a new session only: its
            # generator moves on from run to run within one
            def fresh(feeds):
                return ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"]).run(None, feeds)

            return fresh
        return lambda feeds: session.run(None, feeds)

    def _make_reference(self):
        # loaded only for the models that need them: most runs use onnxruntime alone
        from onnx.reference import ReferenceEvaluator

        from onnx_autodiff.conformance.kernels import FLOAT64_KERNELS

        evaluator = ReferenceEvaluator(self.model, new_ops=list(FLOAT64_KERNELS))
        return lambda feeds: evaluator.run(None, feeds)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        # copies: onnxruntime may write into a fed array (training BatchNormalization updates its
        # running mean and variance in place), which would move the caller's base point
        feeds = {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in feeds.items()}
        return [np.asarray(out) for out in self._run(feeds)]


def _seeded(model: onnx.ModelProto) -> bool:
    """Whether a node of the main graph has a ``seed`` attribute (a seeded random op)."""
    return any(a.name == "seed" for node in model.graph.node for a in node.attribute)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when empty), at most 300 characters."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]
