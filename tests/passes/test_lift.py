"""LiftConstantsPass: the main graph's Constants become initializers, except graph outputs and
before IR version 4. LiftWeightConstantsPass: weights stored as Constants, in If branches too,
become main-graph initializers (one for a tensor both branches hold) and go back by write_back."""

import numpy as np
import onnx
import onnx_ir as ir
from helpers import make_model
from onnx import helper, numpy_helper

TWO = numpy_helper.from_array(np.full((2, 3), 2, np.float32))


def model_with_constants(ir_version=None):
    nodes = [helper.make_node("Constant", [], ["two"], value=TWO), helper.make_node("Mul", ["x", "two"], ["y"]),
             helper.make_node("Constant", [], ["out"], value=TWO)]
    proto = make_model(nodes, {"x": np.ones((2, 3), np.float32)}, ["y", "out"])
    if ir_version is not None:
        proto.ir_version = ir_version
    return ir.from_proto(proto)


def test_a_constant_becomes_an_initializer_and_a_graph_output_stays():
    from onnx_autodiff.passes.lift import LiftConstantsPass

    model = model_with_constants()
    assert LiftConstantsPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Mul", "Constant"]
    lifted = model.graph.initializers["two"]
    assert model.graph.node(0).inputs[1] is lifted
    np.testing.assert_array_equal(lifted.const_value.numpy(), np.full((2, 3), 2, np.float32))
    assert not LiftConstantsPass()(model).modified


def test_nothing_is_lifted_before_ir_version_4():
    from onnx_autodiff.passes.lift import LiftConstantsPass

    model = model_with_constants(ir_version=3)
    assert not LiftConstantsPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Constant", "Mul", "Constant"] and not model.graph.initializers


def _if_model(then_constants, else_constants, main_constants=()):
    """An If whose branches each add their Constants (name -> array) to x; the main graph's
    Constants are added after it."""
    from onnx import TensorProto

    def branch(tag, constants):
        nodes, total = [], "x"
        for i, (name, array) in enumerate(constants.items()):
            nodes += [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array.astype(np.float32))),
                      helper.make_node("Add", [total, name], [f"{tag}_sum{i}"])]
            total = f"{tag}_sum{i}"
        nodes.append(helper.make_node("Identity", [total], [f"{tag}_out"]))
        return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(f"{tag}_out", TensorProto.FLOAT, [2, 3])])

    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch("then", then_constants),
                              else_branch=branch("else", else_constants))]
    total = "y"
    for i, (name, array) in enumerate(dict(main_constants).items()):
        nodes += [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array.astype(np.float32))),
                  helper.make_node("Mul", [total, name], [f"main{i}"])]
        total = f"main{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info(total, TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


W = np.arange(6.0).reshape(2, 3)


def _lifted(proto):
    from onnx_autodiff.passes.lift import LiftWeightConstantsPass

    model = ir.from_proto(proto)
    lift = LiftWeightConstantsPass()
    lift(model)
    return model, {w.initializer: [(s.path, s.output) for s in w.sites] for w in lift.lifted}


def test_one_tensor_in_both_branches_of_an_if_is_one_weight():
    """Equal bytes of more than one value in the two branches: one initializer, read by both."""
    model, lifted = _lifted(_if_model({"w_then": W}, {"w_else": W}))
    assert lifted == {"w_then": [((("y", "then_branch"),), "w_then"), ((("y", "else_branch"),), "w_else")]}
    assert not any(n.op_type == "Constant" for g in (model.graph.node(0).attributes[k].value
                                                     for k in ("then_branch", "else_branch")) for n in g)


def test_weights_that_merely_start_equal_stay_apart():
    """Zeros under two names in the two branches are two weights (one name: one); equal bytes in
    one graph, where both are read in the same call, are two as well."""
    zeros = np.zeros((2, 3))
    assert list(_lifted(_if_model({"a": zeros}, {"b": zeros}))[1]) == ["a", "b"]
    assert list(_lifted(_if_model({"z": zeros}, {"z": zeros}))[1]) == ["z"]
    assert list(_lifted(_if_model({"a": W}, {"b": W + 1}, {"m1": W, "m2": W}))[1]) == ["a", "b", "m1", "m2"]


def test_lifted_weights_keep_the_model_and_go_back_into_their_constants():
    import onnxruntime as ort

    from onnx_autodiff.passes.lift import ConstantSite, LiftedWeight, write_back

    proto = _if_model({"a": W, "shared": W * 2}, {"b": W - 1, "shared_else": W * 2}, {"m": W + 3})
    model, lifted = _lifted(proto)
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.ones((2, 3), np.float32), "c": np.array(False)}
    expected = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_array_equal(ort.InferenceSession(out.SerializeToString()).run(None, feeds)[0], expected)
    entries = [LiftedWeight(name, tuple(ConstantSite(tuple(path), output) for path, output in sites))
               for name, sites in lifted.items()]
    write_back(proto.graph, entries, {"shared": np.full((2, 3), 7, np.float32), "m": np.ones((2, 3), np.float32)})
    after = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_array_equal(after, (1 + (W - 1) + 7).astype(np.float32))


def test_a_one_element_weight_is_lifted_and_a_scale_stays():
    """A Conv with one output channel reads a one-element bias: a weight; a one-element Mul
    factor is a scale, as a one-element initializer is."""
    from onnx import TensorProto

    nodes = [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(np.ones((1, 1, 2, 2), np.float32))),
             helper.make_node("Constant", [], ["b"], value_floats=[0.5]),
             helper.make_node("Conv", ["x", "w", "b"], ["c"]),
             helper.make_node("Constant", [], ["s"], value_float=2.0),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])])
    model, lifted = _lifted(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert list(lifted) == ["w", "b"] and [n.op_type for n in model.graph] == ["Conv", "Constant", "Mul"]
