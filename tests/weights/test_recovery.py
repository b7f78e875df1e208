"""Parameter recovery on small hand-written models in the exporters' forms, each piece of evidence
alone: dynamo's node metadata, TorchScript's node paths and Identity nodes, value identity."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.passes.parameters import default_parameters, parameter_rows
from onnx_autodiff.weights.recovery import (
    EXPORTER_KIND,
    FOLDED_FROM,
    FX_NODE,
    NAME_SCOPES,
    ORIGINAL_NAME,
    RecoverParametersPass,
    is_torch_export,
    recover_parameters,
)
from onnx_autodiff.training import Trainer, generate_artifacts

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((4, 3)).astype(np.float32)  # fc1.weight [out, in] as torch holds it
W2 = RNG.standard_normal((4, 4)).astype(np.float32)


def _meta(proto_like, **props):
    for key, value in props.items():
        proto_like.metadata_props.add(key=key, value=value)


def _fx(target, *args):
    return (f"%out : [num_users=1] = call_function[target=torch.ops.{target}](args = "
            f"({', '.join(args)}), kwargs = {{}})")


def dynamo_like() -> onnx.ModelProto:
    """y = norm2 * (fc2(norm1 * fc1(x))) as optimize=True writes it: fc1.weight folded into its
    transpose val_1, fc2.weight likewise (val_2), the two norm weights (ones) stored once."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    inits = [numpy_helper.from_array(W1.T.copy(), "val_1"), numpy_helper.from_array(W2.T.copy(), "val_2"),
             numpy_helper.from_array(np.ones(4, np.float32), "norm1.weight")]
    nodes = [
        helper.make_node("MatMul", ["x", "val_1"], ["h"], name="node_linear"),
        helper.make_node("Mul", ["norm1.weight", "h"], ["n"], name="node_mul"),
        helper.make_node("MatMul", ["n", "val_2"], ["h2"], name="node_linear_1"),
        helper.make_node("Mul", ["norm1.weight", "h2"], ["y"], name="node_mul_1"),
    ]
    _meta(nodes[0], **{FX_NODE: _fx("aten.linear.default", "%x", "%p_fc1_weight"), NAME_SCOPES: "['', 'fc1']"})
    _meta(nodes[1], **{FX_NODE: _fx("aten.mul.Tensor", "%p_norm1_weight", "%linear"), NAME_SCOPES: "['', 'norm1']"})
    _meta(nodes[2], **{FX_NODE: _fx("aten.linear.default", "%mul", "%p_fc2_weight"), NAME_SCOPES: "['', 'fc2']"})
    _meta(nodes[3], **{FX_NODE: _fx("aten.mul.Tensor", "%p_norm2_weight", "%linear_1"), NAME_SCOPES: "['', 'norm2']"})
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    info = {
        "val_1": {FOLDED_FROM: "['fc1.weight']"},
        "val_2": {FOLDED_FROM: "['fc2.weight']"},
        "norm1.weight": {EXPORTER_KIND: "PARAMETER", ORIGINAL_NAME: "p_norm1_weight"},
    }
    shapes = {t.name: list(t.dims) for t in inits}
    for name, props in info.items():
        value_info = helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[name])
        _meta(value_info, **props)
        graph.value_info.append(value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def torchscript_like() -> onnx.ModelProto:
    """The same network as the TorchScript exporter writes it: the transposes as onnx::MatMul_*
    constants under module paths, norm2.weight an Identity of norm1.weight, and a head tied to
    fc2 stored once more as a constant equal to fc2's."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    inits = [numpy_helper.from_array(W1.T.copy(), "onnx::MatMul_7"), numpy_helper.from_array(W2.T.copy(), "onnx::MatMul_8"),
             numpy_helper.from_array(W2.copy(), "head.weight"),
             numpy_helper.from_array(np.ones(4, np.float32), "norm1.weight")]
    nodes = [
        helper.make_node("Identity", ["norm1.weight"], ["norm2.weight"], name="Identity_0"),
        helper.make_node("MatMul", ["x", "onnx::MatMul_7"], ["h"], name="/fc1/MatMul"),
        helper.make_node("Mul", ["norm1.weight", "h"], ["n"], name="/norm1/Mul"),
        helper.make_node("MatMul", ["n", "onnx::MatMul_8"], ["h2"], name="/fc2/MatMul"),
        helper.make_node("Mul", ["norm2.weight", "h2"], ["m"], name="/norm2/Mul"),
        helper.make_node("Gemm", ["m", "head.weight"], ["y"], name="/head/Gemm", transB=1),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto, x):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_dynamo_metadata():
    recovery = recover_parameters(ir.from_proto(dynamo_like()))
    found = {p.name: (p.initializer, p.transposed, p.shape, p.found_by) for p in recovery.parameters}
    assert found == {
        "fc1.weight": ("val_1", True, (4, 3), "folded_from"),
        "norm1.weight": ("norm1.weight", False, (4,), "exporter mark"),
        "fc2.weight": ("val_2", True, (4, 4), "folded_from"),
        "norm2.weight": ("norm1.weight", False, (4,), "fx_node"),  # stored once with norm1's
    }


def test_torchscript_paths_identities_and_value_identity():
    recovery = recover_parameters(ir.from_proto(torchscript_like()))
    found = {p.name: (p.initializer, p.transposed, p.shape, p.found_by, p.copies, p.aliases) for p in recovery.parameters}
    assert found == {
        "fc1.weight": ("onnx::MatMul_7", True, (4, 3), "node path", (), ()),
        "fc2.weight": ("onnx::MatMul_8", True, (4, 4), "node path", (("head.weight", False),), ("head.weight",)),
        "norm1.weight": ("norm1.weight", False, (4,), "name", (), ()),
        "norm2.weight": ("norm1.weight", False, (4,), "Identity node", (), ()),
    }


@pytest.mark.parametrize("make", [dynamo_like, torchscript_like])
def test_rewrite_computes_the_same_and_gives_each_parameter_its_tensor(make):
    proto = make()
    before = proto.SerializeToString()
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    for tie in (True, False):
        model = ir.from_proto(proto)
        rewrite = RecoverParametersPass(tie=tie)
        rewrite(model)
        result = ir.to_proto(model)
        onnx.checker.check_model(result, full_check=True)
        np.testing.assert_allclose(_run(result, x), _run(proto, x), rtol=1e-6)
        homes = [p.initializer for p in rewrite.recovered]
        assert len(set(homes)) == len(homes) == 4  # one tensor per parameter
        again = recover_parameters(ir.from_proto(result))  # the rewrite is a fixed point
        assert sorted((p.name, p.initializer, p.transposed) for p in again.parameters) == sorted(
            (p.name, p.initializer, p.transposed) for p in rewrite.recovered)
        assert {name for p in rewrite.recovered for name, _ in p.copies} == (
            set() if tie or make is dynamo_like else {"head.weight"})
    assert proto.SerializeToString() == before  # the input is not changed
    first = ir.to_proto(RecoverParametersPass()(ir.from_proto(proto)).model).SerializeToString(deterministic=True)
    second = ir.to_proto(RecoverParametersPass()(ir.from_proto(proto)).model).SerializeToString(deterministic=True)
    assert first == second


def _torch_like_sgd(proto, lr, steps, x, labels):
    """The SGD steps on the module's own tensors (torch layout, untied), written out in numpy:
    fc1, fc2 (tied with the head in torchscript_like), norm1, norm2."""
    w1, w2 = W1.astype(np.float64), W2.astype(np.float64)
    g1, g2 = np.ones(4), np.ones(4)
    tied = any(t.name == "head.weight" for t in proto.graph.initializer)
    for _ in range(steps):
        h = x @ w1.T
        n = g1 * h
        h2 = n @ w2.T
        m = g2 * h2
        y = m @ w2.T if tied else m
        dy = 2 * (y - labels) / y.size
        dw2 = dm = 0
        if tied:
            dw2 = dy.T @ m
            dm = dy @ w2
        else:
            dm = dy
        dg2 = (dm * h2).sum(0)
        dh2 = dm * g2
        dw2 = dw2 + dh2.T @ n
        dn = dh2 @ w2
        dg1 = (dn * h).sum(0)
        dh = dn * g1
        dw1 = dh.T @ x
        w1, w2, g1, g2 = w1 - lr * dw1, w2 - lr * dw2, g1 - lr * dg1, g2 - lr * dg2
    return {"fc1.weight": w1, "fc2.weight": w2, "norm1.weight": g1, "norm2.weight": g2}


@pytest.mark.parametrize("make", [dynamo_like, torchscript_like])
def test_training_is_the_modules(make):
    """SGD on the artifacts equals SGD on the module's own tensors: the folded transposes train as
    the weights, the shared norm tensor as two parameters, the tied head as fc2."""
    proto = make()
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    labels = RNG.standard_normal((2, 4)).astype(np.float32)
    artifacts = generate_artifacts(proto, loss="mse", optimizer="sgd", optimizer_options={"lr": 0.1})
    assert len(artifacts.params) == 4
    trainer = Trainer(artifacts)
    for _ in range(3):
        trainer.step({"x": x, "labels": labels})
    want = _torch_like_sgd(proto, 0.1, 3, x.astype(np.float64), labels.astype(np.float64))
    state = trainer.module_state_dict()
    for name, value in want.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    exported = trainer.export()
    assert [t.name for t in exported.graph.initializer][: len(proto.graph.initializer)] == [
        t.name for t in proto.graph.initializer]
    values = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    if make is torchscript_like:  # the tied copy is written from the trained fc2
        np.testing.assert_array_equal(values["head.weight"], state["fc2.weight"])


def test_plain_models_keep_the_plain_rules():
    """Not an export: parameters are the initializers by their own names, nothing is rewritten."""
    proto = torchscript_like()
    for node in proto.graph.node:
        node.name = node.name.strip("/").replace("/", "_")
    model = ir.from_proto(proto)
    recovery = recover_parameters(model)
    assert not recovery.torch_export
    assert {p.name for p in recovery.parameters} == {"onnx::MatMul_7", "onnx::MatMul_8", "head.weight", "norm1.weight"}
    assert {v.name for v in default_parameters(model).parameters} == {p.name for p in recovery.parameters}


def test_torch_export_told_from_the_proto_as_from_onnx_ir():
    """generate_artifacts reads the marks off the proto, without converting it."""
    plain = torchscript_like()
    for node in plain.graph.node:
        node.name = node.name.strip("/").replace("/", "_")
    marked_initializer = onnx.ModelProto()
    marked_initializer.CopyFrom(plain)
    name = marked_initializer.graph.initializer[0].name
    info = helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
    _meta(info, **{EXPORTER_KIND: "PARAMETER"})
    marked_initializer.graph.value_info.append(info)
    for proto, want in ((dynamo_like(), True), (torchscript_like(), True), (plain, False), (marked_initializer, True)):
        assert is_torch_export(proto) is want
        assert is_torch_export(ir.from_proto(proto)) is want


def test_parameter_rows():
    rows = {row.name or row.initializer: row for row in parameter_rows(ir.from_proto(dynamo_like()))}
    assert rows["fc1.weight"].initializer == "val_1" and rows["fc1.weight"].transform == "transpose"
    assert rows["fc1.weight"].shape == (4, 3) and rows["fc1.weight"].trained
    assert "shared with 1 other" in rows["norm2.weight"].why and rows["norm2.weight"].trained
