"""Outputs: each output a value of its own, under a fresh name; carried outputs recorded."""

from __future__ import annotations

import onnx_ir as ir

from onnx_autodiff.toolkit import Namer, OpBuilder
from onnx_autodiff.training.generation.outputs import Outputs
from onnx_autodiff.training.manifest import Carried


def graph_with(*names):
    values = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2])) for n in names]
    return ir.Graph(values, [], nodes=[], opset_imports={"": 18}), values


def test_inputs_are_published_through_an_identity_and_carried():
    graph, (w, g) = graph_with("w", "g")
    namer = Namer.for_graph(graph, prefix="opt")
    outputs = Outputs(OpBuilder(18, namer), namer)
    loss = outputs.add_loss(w)  # a graph input: an Identity of it
    assert loss is not w and loss.name == "loss" and loss.producer().op_type == "Identity"
    new = outputs.op.Sub(w, g)
    out = outputs.add_carried(w, new)
    assert out is new and out.name == "w.new" and out.shape == w.shape
    again = outputs.add_carried(g, new)  # already an output: a copy of its own
    assert again is not new and again.name == "g.new"
    assert outputs.values == [loss, out, again]
    assert outputs.carry == [Carried("w", "w", "w.new"), Carried("g", "g", "g.new")]


def test_outputs_as_they_are_keep_their_names():
    graph, (x,) = graph_with("x")
    namer = Namer.for_graph(graph)
    outputs = Outputs(OpBuilder(18, namer), namer)
    y = outputs.op.Relu(x)
    y.name = namer.fresh("y")
    assert outputs.add_as_is(y) is y and y.name == "y"
    copy = outputs.add_as_is(y)  # already an output: a copy under a name of its own
    assert copy is not y and copy.name.startswith("y") and copy.name != "y"
    assert outputs.add_as_is(x).producer().op_type == "Identity"
