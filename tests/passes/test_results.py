"""What the passes return: PassResult subclasses carrying the names chosen and what was left out;
the pass attributes are a view of the last result; a PassManager returns a plain PassResult."""

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import AutodiffPass, AutodiffResult, CleanupResult, JvpPass, TransformResult, cleanup_passes


def _model(nodes, initializers, output_shape=()):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(output_shape))],
        [numpy_helper.from_array(np.asarray(v, np.float32), name) for name, v in initializers.items()],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _scaled_sum():
    """y = sum(X·W · two): W is a parameter, the one-element ``two`` a constant."""
    nodes = [helper.make_node("MatMul", ["X", "W"], ["xw"]), helper.make_node("Mul", ["xw", "two"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0)]
    return _model(nodes, {"W": np.ones((3, 4)), "two": 2.0})


def _vector():
    """y = X·W, a [2, 4] output: the seed is an input."""
    return _model([helper.make_node("MatMul", ["X", "W"], ["y"])], {"W": np.ones((3, 4))}, [2, 4])


def test_autodiff_returns_its_result_and_the_attributes_view_the_last_one():
    autodiff = AutodiffPass(of="y")
    assert (autodiff.last_result, autodiff.seed_name, autodiff.gradient_names, autodiff.left_out) == (None, None, {}, [])
    model = _scaled_sum()
    result = autodiff(model)
    assert isinstance(result, AutodiffResult) and isinstance(result, ir.passes.PassResult)
    assert result.model is model and result.modified
    assert result.seed_name is None
    assert result.gradient_names == {"W": "grad_W"}
    assert result.left_out == ["two"]
    assert [o.name for o in model.graph.outputs] == ["y", "grad_W"]
    assert autodiff.last_result is result
    assert (autodiff.seed_name, autodiff.gradient_names, autodiff.left_out) == (None, {"W": "grad_W"}, ["two"])

    again = autodiff(_vector())  # a second call: the view follows it, nothing of the first stays
    assert again is not result and autodiff.last_result is again
    assert again.seed_name == "dy" and again.model.graph.inputs[-1].name == "dy"
    assert again.gradient_names == {"W": "grad_W"} and again.left_out == []
    assert (autodiff.seed_name, autodiff.left_out) == ("dy", [])
    assert result.left_out == ["two"] and result.seed_name is None  # the first result is unchanged


def test_explicit_wrt_leaves_nothing_out_and_keeps_its_order():
    result = AutodiffPass(of="y", wrt=["two", "W"])(_scaled_sum())
    assert result.gradient_names == {"two": "grad_two", "W": "grad_W"} and result.left_out == []


def test_a_pass_manager_returns_a_plain_result_and_the_passes_keep_theirs():
    autodiff = AutodiffPass(of="y")
    cleanup = cleanup_passes()[0]
    model = _scaled_sum()
    result = ir.passes.PassManager([autodiff, cleanup])(model)
    assert type(result) is ir.passes.PassResult and result.model is model
    assert isinstance(autodiff.last_result, AutodiffResult) and autodiff.last_result.gradient_names == {"W": "grad_W"}
    assert autodiff.last_result.left_out == ["two"]
    assert isinstance(cleanup.last_result, CleanupResult) and cleanup.last_result.model is model


def test_cleanup_returns_the_rounds_it_took():
    cleanup = cleanup_passes()[0]
    assert cleanup.rounds == 0 and cleanup.last_result is None
    model = AutodiffPass(of="y")(_scaled_sum()).model
    result = cleanup(model)
    assert isinstance(result, CleanupResult) and result.modified
    assert 1 < result.rounds < cleanup.max_rounds and cleanup.rounds == result.rounds
    second = cleanup(model)  # at the fixed point: one round finds nothing
    assert not second.modified and second.rounds == 1 and cleanup.rounds == 1 and result.rounds > 1


def test_transforms_return_the_inputs_and_outputs_they_added():
    jvp = JvpPass("y")
    assert (jvp.input_names, jvp.output_names, jvp.left_out) == ({}, {}, [])
    result = jvp(_scaled_sum())
    assert isinstance(result, TransformResult)
    assert result.input_names == {"W": "t_W"} and result.output_names == {"y": "jvp_y"} and result.left_out == ["two"]
    assert [v.name for v in result.model.graph.inputs] == ["X", "t_W"]
    assert (jvp.input_names, jvp.output_names, jvp.left_out) == ({"W": "t_W"}, {"y": "jvp_y"}, ["two"])
