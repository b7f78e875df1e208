"""indexing rules."""

from __future__ import annotations

from onnx_autodiff.rules.registry import rule  # noqa: F401
