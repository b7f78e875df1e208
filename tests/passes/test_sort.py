"""SortPass: a graph out of order is sorted, one in order is left as it is."""

import onnx_ir as ir

from onnx_autodiff.passes.sort import SortPass, in_order


def chain():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    first = ir.Node("", "Exp", [x], num_outputs=1)
    second = ir.Node("", "Neg", [first.outputs[0]], num_outputs=1)
    return x, first, second


def test_a_graph_out_of_order_is_sorted():
    x, first, second = chain()
    graph = ir.Graph([x], [second.outputs[0]], nodes=[second, first], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=8)
    assert not in_order(graph)
    assert SortPass()(model).modified
    assert list(graph) == [first, second] and in_order(graph)


def test_a_graph_in_order_stays():
    x, first, second = chain()
    graph = ir.Graph([x], [second.outputs[0]], nodes=[first, second], opset_imports={"": 18})
    assert not SortPass()(ir.Model(graph, ir_version=8)).modified
    assert list(graph) == [first, second]
