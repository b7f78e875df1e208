"""The model's opset imports: refuse those newer than the installed onnx knows, and convert a model
whose gradient rules need a newer default-domain opset than it imports.

A rule that cannot emit its gradient at the model's opset raises an OpsetTooOldError carrying
the opset N it needs (``shapes.require_opset``). The passes
build through :func:`build_upgrading`: on such an error it converts the model with
``onnx.version_converter`` to opset N, the lowest that serves that rule, and builds again (a later
rule may ask for more). A conversion is reported as one warning line on this module's logger;
with ``upgrade=False`` the error says which rule needs which opset and how to convert instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import onnx
import onnx_ir as ir

from onnx_autodiff.errors import AutodiffError, OpsetTooOldError, UnsupportedModelError
from onnx_autodiff.modelfile import from_proto, to_proto

logger = logging.getLogger(__name__)


class OpsetError(UnsupportedModelError):
    """The model's opset is newer than onnx knows, or onnx.version_converter cannot convert it."""


def known_opsets() -> dict[str, int]:
    """The newest opset of each domain the installed onnx has schemas for."""
    return {domain: newest for domain, (_, newest) in onnx.defs.C.schema_version_map().items()}


def _imports(model: ir.Model | onnx.ModelProto) -> Iterable[tuple[str, int]]:
    if isinstance(model, onnx.ModelProto):
        yield from ((o.domain, o.version) for o in model.opset_import)
        yield from ((o.domain, o.version) for f in model.functions for o in f.opset_import)
        return
    yield from model.opset_imports.items()
    for function in model.functions.values():
        yield from function.opset_imports.items()


def check_known_opsets(model: ir.Model | onnx.ModelProto) -> None:
    """Refuse a model importing an opset newer than the installed onnx knows: its nodes could not
    be checked, typed or converted, and onnxruntime would refuse the model built from it."""
    known = known_opsets()
    for domain, version in _imports(model):
        newest = known.get("" if domain == "ai.onnx" else domain)
        if newest is not None and version > newest:
            raise OpsetError(
                f"the model imports opset {version} of domain {domain or 'ai.onnx'}, but the "
                f"installed onnx {onnx.__version__} knows opsets up to {newest}: its operators "
                "cannot be checked or differentiated, and onnxruntime would refuse the result. "
                f"Export the model for opset {newest} or older, or install a newer onnx"
            )


def default_opset(model: ir.Model) -> int | None:
    """The model's default-domain opset (None when it imports none)."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def required_opset(error: AutodiffError) -> tuple[int, str] | None:
    """(N, the rule's message) when ``error`` is a rule asking for default-domain opset N."""
    needed = getattr(error, "needed", None) if isinstance(error, OpsetTooOldError) else None
    return None if needed is None else (needed, str(error))


def convert_proto(proto: onnx.ModelProto, opset: int, reason: str) -> onnx.ModelProto:
    """``proto`` converted to default-domain ``opset`` by onnx.version_converter."""
    newest = known_opsets()[""]
    if opset > newest:
        raise OpsetError(
            f"{reason}, newer than the installed onnx {onnx.__version__} knows ({newest}): "
            "install a newer onnx"
        )
    try:
        converted = onnx.version_converter.convert_version(proto, opset)
    except Exception as error:  # noqa: BLE001 - the converter raises RuntimeError, ConvertError, ...
        old = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
        detail = " ".join(f"{type(error).__name__}: {error}".split())
        raise OpsetError(
            f"{reason}, and onnx.version_converter could not convert the model from opset {old} "
            f"to {opset} ({detail}): convert it by other means, or export it for opset {opset} or later"
        ) from error
    # The converter keeps the IR version, though the new opset needs a newer one: an IR version 3
    # model's new initializers (Pad-11's pads) would have to be graph inputs too.
    needed = onnx.helper.find_min_ir_version_for(list(converted.opset_import), ignore_unknown=True)
    converted.ir_version = max(converted.ir_version, needed)
    return converted


def convert_in_place(model: ir.Model, opset: int, reason: str, source: ir.Model | None = None) -> None:
    """Convert ``model`` (or put ``source`` converted in its place) to default-domain ``opset``.

    The model and its graph stay the same objects, as an in-place pass needs (a caller holding
    ``model.graph`` sees the converted graph); its nodes and values are the converted ones.
    """
    converted = from_proto(convert_proto(to_proto(source or model), opset, reason))
    graph, new = model.graph, converted.graph
    graph.remove(list(graph))
    graph.inputs.clear()
    graph.outputs.clear()
    graph.initializers.clear()
    nodes, inputs, outputs = list(new), list(new.inputs), list(new.outputs)
    initializers = list(new.initializers.values())
    new.remove(nodes)
    new.inputs.clear()
    new.outputs.clear()
    new.initializers.clear()
    graph.extend(nodes)
    graph.inputs.extend(inputs)
    graph.outputs.extend(outputs)
    for value in initializers:
        graph.register_initializer(value)
    graph.opset_imports.clear()
    graph.opset_imports.update(new.opset_imports)
    model.ir_version = converted.ir_version
    model.functions.clear()
    model.functions.update(converted.functions)


def build_upgrading(
    model: ir.Model, build: Callable[[ir.Model], object], upgrade: bool = True, pristine: bool = False
):
    """``build(model)``; while it fails because a rule needs a newer default-domain opset, convert
    the model to that opset and build again (``upgrade=False``: raise an error saying how to
    convert instead). Refuses opsets newer than onnx knows before building.

    A failed build may leave the model annotated (inferred shapes, saved outputs): the model is
    converted as it is then. ``pristine=True`` converts a copy taken before the build instead,
    for builds that leave more (a second sweep's nodes).
    """
    check_known_opsets(model)
    first = default_opset(model)
    reasons: list[str] = []
    while True:
        original = model.clone() if pristine else None
        try:
            result = build(model)
            break
        except AutodiffError as error:
            current, needed = default_opset(model), required_opset(error)
            if current is None or needed is None or needed[0] <= current:
                raise
            opset, reason = needed
            if not upgrade:
                refusal = type(error)(
                    f"{reason}, and conversion is off: convert "
                    f"the model first with onnx.version_converter.convert_version(model, {opset}), "
                    "or let the pass convert it (upgrade_opset=True)"
                )
                refusal.__dict__.update(vars(error))
                refusal.reason = reason  # the rule's own message (build_proto_upgrading converts on it)
                raise refusal from error
            try:
                convert_in_place(model, opset, reason, original)
            except OpsetError as failure:  # still the rule's refusal, now with why it stands
                raise type(error)(str(failure)) from failure
            reasons.append(reason)
    if reasons:
        logger.warning(
            "converted the model from opset %s to %s with onnx.version_converter: %s",
            first, default_opset(model), "; ".join(reasons),
        )
    return result


def build_proto_upgrading(
    proto: onnx.ModelProto,
    build: Callable[[onnx.ModelProto], object],
    upgrade: bool = True,
):
    """``build(proto)``; while it fails because a rule needs a newer default-domain opset N,
    ``build`` again on ``proto`` converted to N by onnx.version_converter (a later rule may ask for
    more; ``upgrade=False``: the error as the build raised it). Refuses opsets newer than onnx knows
    before building.

    For builders that make several models from one forward graph (training artifacts): the first
    model's build finds the opset, and the proto it was built from is the one the others start
    from, without a trial build to find it beforehand. ``build`` returns that proto with what it
    built. Each attempt starts from ``proto`` as given, so the result is the one of converting it
    once to the final opset.
    """
    check_known_opsets(proto)
    first = current = _proto_opset(proto)
    candidate, reasons = proto, []
    while True:
        try:
            result = build(candidate)
            break
        except AutodiffError as error:
            needed = required_opset(error)
            if not upgrade or current is None or needed is None or needed[0] <= current:
                raise
            opset, reason = needed[0], _rule_message(error)
            try:
                candidate = convert_proto(proto, opset, reason)
            except OpsetError as failure:  # still the rule's refusal, now with why it stands
                raise type(error)(str(failure)) from failure
            reasons.append(reason)
            current = opset
    if reasons:
        logger.warning(
            "converted the model from opset %s to %s with onnx.version_converter: %s",
            first, current, "; ".join(reasons),
        )
    return result


def _proto_opset(proto: onnx.ModelProto) -> int | None:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)


def _rule_message(error: BaseException) -> str:
    """The message of the rule's own error behind ``error`` (a pass asked not to convert raises a
    refusal that says how to convert, with the rule's message as its ``reason``)."""
    return getattr(error, "reason", None) or str(error)
