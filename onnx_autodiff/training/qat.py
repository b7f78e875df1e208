"""Quantization-aware training: what to fake-quantize, and how its ranges are observed.

The build inserts QuantizeLinear → DequantizeLinear pairs (QDQ, the form onnxruntime's quantizer
writes and its kernels fuse) where the deployed model quantizes, and trains through them with the
straight-through estimator (:mod:`rules.qdq`):

- the weights of Conv, ConvTranspose, Gemm and MatMul: int8 per output channel, or int4 (MatMul
  and Gemm in blocks of ``block_size`` along the reduction axis, convolutions per output channel),
  symmetric (zero point 0) or asymmetric; their ranges are those of the weights of the step, as
  torch's per-channel observer with averaging constant 1 measures them;
- the activations those ops read (their first input), as uint8 per tensor, asymmetric: the range
  a moving average of each batch's minimum and maximum, as ``torch.ao.quantization``'s
  ``MovingAverageMinMaxObserver`` keeps it (the first batch's taken as it is), during the first
  ``calibration_steps`` optimiser steps; then frozen.

The scale and zero point follow torch's observers: the range is widened to hold 0; symmetric (on
the restricted range ±qmax: ±127, ±7, as onnxruntime's quantizer takes symmetric weights and
torch's ``quant_min=-127``), scale = max(|min|, |max|) / qmax; asymmetric, scale = (max − min) /
(qmax − qmin) and zero point = clip(qmin − round(min / scale)); both at least float32's epsilon. No gradient
flows through a range (torch's observers run without one).

BatchNormalization after a convolution is folded into it first, with its running statistics, as
deployed: the folded weight and bias are trained.
"""

from __future__ import annotations

import dataclasses
import fnmatch

from onnx_autodiff.errors import TrainingError

SCHEMES = {
    # scheme: (weight bits, activations quantized)
    "int8": (8, True),
    "int4-weights": (4, False),
    "int4-weights-int8-activations": (4, True),
}
"""The quantization schemes of ``--qat``."""

BLOCK_SIZES = (16, 32, 64, 128, 256)
EXPORT_FORMATS = ("dequantizelinear", "matmulnbits")


@dataclasses.dataclass(frozen=True)
class QatConfig:
    """Quantization-aware training of ``scheme`` (one of :data:`SCHEMES`). ``calibration_steps``:
    the optimiser steps the activations' ranges are observed for, before they freeze;
    ``skip``: shell-style patterns of node or weight names left in float (``*lm_head*``);
    ``symmetric``: the weights' zero point 0; ``block_size``: the int4 blocks of MatMul and Gemm
    weights; ``averaging_constant``: the observers' moving-average weight of a new batch;
    ``quantize_format``: how the exported model stores int4 weights of MatMul and Gemm:
    "dequantizelinear" (QDQ, which onnxruntime fuses into MatMulNBits where it can) or
    "matmulnbits" (onnxruntime's com.microsoft.MatMulNBits, which on-device runtimes load);
    ``learn_scales``: each scale is the observed one times exp(t), t a parameter from 0 trained
    with the others by the scale's LSQ gradient (Esser et al. 2020), so that the ranges keep
    adapting once the observers freeze."""

    scheme: str = "int8"
    calibration_steps: int = 100
    skip: tuple[str, ...] = ()
    symmetric: bool = True
    block_size: int = 32
    averaging_constant: float = 0.01
    quantize_format: str = "dequantizelinear"
    learn_scales: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise TrainingError(f"qat must be one of {', '.join(SCHEMES)}, not {self.scheme!r}")
        if not (isinstance(self.calibration_steps, int) and not isinstance(self.calibration_steps, bool)
                and self.calibration_steps >= 1):
            raise TrainingError(f"qat_calibration_steps must be a whole number >= 1, not {self.calibration_steps!r}")
        if isinstance(self.skip, str):
            object.__setattr__(self, "skip", (self.skip,))
        object.__setattr__(self, "skip", tuple(self.skip))
        if self.block_size not in BLOCK_SIZES:
            raise TrainingError(f"the int4 block size must be one of {', '.join(map(str, BLOCK_SIZES))}, not {self.block_size!r}")
        if self.quantize_format not in EXPORT_FORMATS:
            raise TrainingError(f"the quantized model's format must be one of {', '.join(EXPORT_FORMATS)}, not {self.quantize_format!r}")
        if self.quantize_format == "matmulnbits" and self.weight_bits != 4:
            raise TrainingError("quantize_format 'matmulnbits' stores 4-bit weights: use an int4 qat scheme")
        if not 0.0 < self.averaging_constant <= 1.0:
            raise TrainingError(f"the observers' averaging constant must be in (0, 1], not {self.averaging_constant!r}")

    @property
    def weight_bits(self) -> int:
        return SCHEMES[self.scheme][0]

    @property
    def activations(self) -> bool:
        return SCHEMES[self.scheme][1]

    @property
    def opset(self) -> int:
        """The default-domain opset the fake-quantized model needs: per-axis QuantizeLinear (13),
        int4 and blocks (21)."""
        return 21 if self.weight_bits == 4 else 13

    def skips(self, *names: str | None) -> bool:
        """Whether a pattern of ``skip`` matches one of ``names`` (a node's and its weight's)."""
        return any(fnmatch.fnmatchcase(name, pattern) for name in names if name for pattern in self.skip)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"skip": list(self.skip)}

    @classmethod
    def from_json(cls, document: dict) -> QatConfig:
        return cls(**{**document, "skip": tuple(document.get("skip", ()))})


def qat_config(qat) -> QatConfig | None:
    """``qat`` (a scheme's name, a :class:`QatConfig` or None) as a config."""
    if qat is None or isinstance(qat, QatConfig):
        return qat
    if isinstance(qat, str):
        return QatConfig(qat)
    raise TrainingError(f"qat must be a scheme ({', '.join(SCHEMES)}) or a QatConfig, not {type(qat).__name__}")
