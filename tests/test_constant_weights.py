"""Weights wherever a file keeps them: float Constant nodes (paddle2onnx; silero's If branches, one
per sample rate) and initializers an exporter named after their op (TorchScript's ``onnx::LSTM_209``,
a Conv with a batch normalization folded into it, ``onnx::Conv_12``) are parameters: listed by
``params``, differentiated by default, trained, and written back where they came from."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import assert_gradients
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.passes.lift import LiftWeightConstantsPass
from onnx_autodiff.passes.parameters import default_parameters, parameter_rows

RNG = np.random.default_rng(7)
OPSET_11 = [helper.make_opsetid("", 11)]


def _const(name, array, dtype=np.float32):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array, dtype), name),
                            name=f"{name}_node")


def _normal(*shape, scale=0.3):
    return RNG.standard_normal(shape) * scale


def paddle_cnn() -> onnx.ModelProto:
    """paddle2onnx's layout at opset 11: every weight a Constant node, a second Conv's weight stored
    flat and Reshaped, its bias read through Identity, a BatchNormalization's four tensors, a
    MatMul + Add head whose bias is float16 Cast to float; a Resize's float scales and an
    epsilon-like scalar are constants, not weights."""
    nodes = [
        _const("scales", [1, 1, 2, 2]), _const("roi", np.zeros(0)),
        helper.make_node("Resize", ["x", "roi", "scales"], ["up"], mode="nearest"),
        _const("conv1_w", _normal(4, 2, 3, 3)), _const("conv1_b", _normal(4)),
        helper.make_node("Conv", ["up", "conv1_w", "conv1_b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        _const("bn_scale", 1 + _normal(4)), _const("bn_bias", _normal(4)),
        _const("bn_mean", _normal(4)), _const("bn_var", 1 + np.abs(_normal(4))),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["b1"], name="bn"),
        helper.make_node("Relu", ["b1"], ["r1"]),
        _const("conv2_w_flat", _normal(4 * 4 * 3 * 3)),
        helper.make_node("Constant", [], ["conv2_shape"], value=numpy_helper.from_array(np.array([4, 4, 3, 3], np.int64))),
        helper.make_node("Reshape", ["conv2_w_flat", "conv2_shape"], ["conv2_w"]),
        _const("conv2_b_raw", _normal(4)), helper.make_node("Identity", ["conv2_b_raw"], ["conv2_b"]),
        helper.make_node("Conv", ["r1", "conv2_w", "conv2_b"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        _const("half", 0.5), helper.make_node("Mul", ["c2", "half"], ["c2h"]),
        helper.make_node("GlobalAveragePool", ["c2h"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        _const("fc_w", _normal(4, 5)), helper.make_node("MatMul", ["flat", "fc_w"], ["fc"]),
        _const("fc_b16", _normal(5), np.float16), helper.make_node("Cast", ["fc_b16"], ["fc_b"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["fc", "fc_b"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "paddle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 4, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 5])])
    return helper.make_model(graph, opset_imports=OPSET_11, ir_version=6)


def _branch(tag: str, shared_name: str, shared: np.ndarray, hidden: int = 3) -> onnx.GraphProto:
    """One sample rate's path: a Conv over the chunk, an LSTM, the decoder's shared MatMul; every
    weight a Constant node of this branch."""
    nodes = [
        _const(f"conv_w_{tag}", _normal(4, 1, 3)), _const(f"conv_b_{tag}", _normal(4)),
        helper.make_node("Conv", ["x", f"conv_w_{tag}", f"conv_b_{tag}"], [f"feat_{tag}"], name=f"conv_{tag}"),
        helper.make_node("Transpose", [f"feat_{tag}"], [f"seq_{tag}"], perm=[2, 0, 1]),
        _const(f"lstm_w_{tag}", _normal(1, 4 * hidden, 4)), _const(f"lstm_r_{tag}", _normal(1, 4 * hidden, hidden)),
        _const(f"lstm_b_{tag}", _normal(1, 8 * hidden)),
        helper.make_node("LSTM", [f"seq_{tag}", f"lstm_w_{tag}", f"lstm_r_{tag}", f"lstm_b_{tag}"], [f"y_{tag}"],
                         hidden_size=hidden, name=f"lstm_{tag}"),
        helper.make_node("Constant", [], [f"rows_{tag}"], value=numpy_helper.from_array(np.array([-1, hidden], np.int64))),
        helper.make_node("Reshape", [f"y_{tag}", f"rows_{tag}"], [f"h_{tag}"]),
        _const(shared_name, shared),
        helper.make_node("MatMul", [f"h_{tag}", shared_name], [f"out_{tag}"]),
    ]
    return helper.make_graph(nodes, f"branch_{tag}", [], [helper.make_tensor_value_info(f"out_{tag}", TensorProto.FLOAT, [6, 2])])


def silero_like() -> onnx.ModelProto:
    """silero's layout: an If on the sample rate, each branch with its own Conv and LSTM weights as
    Constant nodes, and the decoder's weight duplicated into both (equal bytes, other names)."""
    decoder = _normal(3, 2)
    nodes = [
        helper.make_node("Constant", [], ["sr16k"], value=numpy_helper.from_array(np.array(16000, np.int64))),
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["out"], then_branch=_branch("16k", "decoder_w", decoder),
                         else_branch=_branch("8k", "decoder_w_8k", decoder), name="rate"),
    ]
    graph = helper.make_graph(nodes, "silero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8]),
                                                helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [6, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)


def torchscript_lstm() -> onnx.ModelProto:
    """The TorchScript exporter's LSTM: its gates reordered into initializers named after the op
    (``onnx::LSTM_209`` W, ``_210`` R, ``_211`` B), the head's weight under its module name."""
    hidden = 3
    inits = {"onnx::LSTM_209": _normal(1, 4 * hidden, 4), "onnx::LSTM_210": _normal(1, 4 * hidden, hidden),
             "onnx::LSTM_211": _normal(1, 8 * hidden), "fc.weight": _normal(2, hidden), "fc.bias": _normal(2)}
    nodes = [
        helper.make_node("LSTM", ["x", "onnx::LSTM_209", "onnx::LSTM_210", "onnx::LSTM_211"], ["y"],
                         hidden_size=hidden, name="/rnn/LSTM"),
        helper.make_node("Constant", [], ["rows"], value=numpy_helper.from_array(np.array([-1, hidden], np.int64)),
                         name="/Constant"),
        helper.make_node("Reshape", ["y", "rows"], ["h"], name="/Reshape"),
        helper.make_node("Gemm", ["h", "fc.weight", "fc.bias"], ["out"], transB=1, name="/fc/Gemm"),
    ]
    return _torchscript(nodes, inits, [5, 1, 4], [5, 2])


def torchscript_folded_conv() -> onnx.ModelProto:
    """The TorchScript exporter with constant folding (optimum's export): a BatchNorm folded into
    the Conv before it, stored as ``onnx::Conv_12`` and ``onnx::Conv_13``."""
    inits = {"onnx::Conv_12": _normal(4, 2, 3, 3), "onnx::Conv_13": _normal(4), "fc.weight": _normal(2, 16),
             "fc.bias": _normal(2)}
    nodes = [
        helper.make_node("Conv", ["x", "onnx::Conv_12", "onnx::Conv_13"], ["c"], name="/conv/Conv"),
        helper.make_node("Relu", ["c"], ["r"], name="/relu/Relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="/Flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["out"], transB=1, name="/fc/Gemm"),
    ]
    return _torchscript(nodes, inits, [2, 2, 4, 4], [2, 2])


def _torchscript(nodes, inits, x_shape, out_shape) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=7,
                             producer_name="pytorch", producer_version="2.13.0")


def _feeds(name: str, sr: int = 16000) -> dict:
    rng = np.random.default_rng(3)
    if name == "paddle":
        return {"x": rng.standard_normal((2, 2, 4, 4)).astype(np.float32)}
    if name == "silero":
        return {"x": rng.standard_normal((1, 1, 8)).astype(np.float32), "sr": np.array(sr, np.int64)}
    if name == "lstm":
        return {"x": rng.standard_normal((5, 1, 4)).astype(np.float32)}
    return {"x": rng.standard_normal((2, 2, 4, 4)).astype(np.float32)}


MODELS = {"paddle": paddle_cnn, "silero": silero_like, "lstm": torchscript_lstm, "conv": torchscript_folded_conv}
SILERO = [f"{kind}_{tag}" for tag in ("16k", "8k")
          for kind in ("conv_w", "conv_b", "lstm_w", "lstm_r", "lstm_b")]
# the tensors the models' layers read as weights (by construction above), each trained by default
WEIGHTS = {
    "paddle": ["conv1_w", "conv1_b", "bn_scale", "bn_bias", "conv2_w_flat", "conv2_b_raw", "fc_w", "fc_b16"],
    "silero": [*SILERO[:5], "decoder_w", *SILERO[5:]],
    "lstm": ["onnx::LSTM_209", "onnx::LSTM_210", "onnx::LSTM_211", "fc.weight", "fc.bias"],
    "conv": ["onnx::Conv_12", "onnx::Conv_13", "fc.weight", "fc.bias"],
}
# float tensors that are no weight, with the reason ``params`` gives
LEFT_OUT = {
    "paddle": {"scales": "read by no differentiable input",
               "bn_mean": "BatchNormalization running statistic", "bn_var": "BatchNormalization running statistic"},
}


def _models():
    return [pytest.param(name, id=name) for name in MODELS]


@pytest.fixture(scope="module")
def models():
    return {name: build() for name, build in MODELS.items()}


@pytest.mark.parametrize("name", _models())
def test_params_lists_the_weights_wherever_stored(models, name):
    proto = models[name]
    onnx.checker.check_model(proto, full_check=True)
    rows = {row.initializer: row for row in parameter_rows(ir.from_proto(proto))}
    assert [n for n in WEIGHTS[name] if rows.get(n) is None or not rows[n].trained] == []
    for tensor, reason in LEFT_OUT.get(name, {}).items():
        assert not rows[tensor].trained and rows[tensor].why.startswith(reason), rows[tensor]
    assert set(rows) == set(WEIGHTS[name]) | set(LEFT_OUT.get(name, {}))  # one-element scales stay nodes
    assert all("exporter constant" not in row.why for row in rows.values())


def test_params_names_the_constants_a_weight_came_from(models, tmp_path, capsys):
    from onnx_autodiff.cli import main

    row = next(r for r in parameter_rows(ir.from_proto(models["silero"])) if r.initializer == "decoder_w")
    assert row.found_by == "Constant 'decoder_w' in then_branch of 'out'; Constant 'decoder_w_8k' in else_branch of 'out'"
    path = tmp_path / "silero.onnx"
    onnx.save(models["silero"], path)
    assert main(["params", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Constant 'lstm_r_8k' in else_branch of 'out'" in text
    assert "11 module parameters (11 trained by default)" in text


def test_lifting_keeps_what_the_model_computes(models):
    for name, proto in models.items():
        lifted = LiftWeightConstantsPass()
        model = ir.from_proto(proto)
        lifted(model)
        out = ir.to_proto(model)
        onnx.checker.check_model(out, full_check=True)
        feeds = _feeds(name, 8000)
        expected = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]
        np.testing.assert_array_equal(ort.InferenceSession(out.SerializeToString()).run(None, feeds)[0], expected)


@pytest.mark.parametrize("name", _models())
def test_gradients_of_the_weights_match_finite_differences(models, name):
    """The default variables of the lifted model, against float64 central differences; the If's
    other branch gets zeros (its weights do not reach the output for this rate)."""
    model = ir.from_proto(models[name])
    wrt = [v.name for v in default_parameters(model).parameters]
    assert set(WEIGHTS[name]) <= set(wrt)
    assert_gradients(ir.to_proto(model), _feeds(name, 8000), wrt)


def _structure(graph: onnx.GraphProto) -> list:
    """Op types in order, each subgraph's nested under its node."""
    return [(n.op_type, [(a.name, _structure(a.g)) for a in n.attribute if a.HasField("g")]) for n in graph.node]


def _stored(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Every float tensor the file holds (initializers and Constant nodes, in subgraphs too)."""
    found = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        for a in node.attribute:
            if a.HasField("g"):
                found.update(_stored(a.g))
    return {k: v for k, v in found.items() if v.dtype.kind == "f"}


@pytest.mark.parametrize("name", _models())
def test_training_lowers_the_loss_and_export_writes_the_weights_back(models, name):
    """A few SGD steps on one batch lower the loss; the exported model has the file's structure
    (Constant nodes in their branches), changed weights where they were stored, and runs."""
    from onnx_autodiff.training import Trainer, generate_artifacts

    proto = models[name]
    feeds = _feeds(name)
    target = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0] + 0.5
    artifacts = generate_artifacts(proto, loss="mse", optimizer="sgd", optimizer_options={"lr": 0.05},
                                   freeze_batchnorm=True)
    assert set(WEIGHTS[name]) <= set(artifacts.params)
    trainer = Trainer(artifacts)
    losses = [trainer.step({**feeds, "labels": target}) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    exported = trainer.export()
    onnx.checker.check_model(exported, full_check=True)
    assert _structure(exported.graph) == _structure(proto.graph)
    before, after = _stored(proto.graph), _stored(exported.graph)
    assert set(before) == set(after)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    reached = [w for w in WEIGHTS[name] if not w.endswith("_8k")]  # (sr 16000 runs the then branch)
    assert set(reached) <= changed and changed <= set(artifacts.params) | {"decoder_w_8k"}
    if name == "silero":  # one parameter, written into both branches' Constants
        np.testing.assert_array_equal(after["decoder_w"], after["decoder_w_8k"])
    result = ort.InferenceSession(exported.SerializeToString()).run(None, feeds)[0]
    assert np.mean((result - target) ** 2) < losses[0]


def test_grad_command_differentiates_the_branch_weights_by_default(models, tmp_path):
    """``onnx-autodiff grad`` with the default variables outputs grad_<name> for the weights of
    both branches and the shared decoder; the decoder's gradient matches central differences of
    the original file, both of its Constants moved together (float32, h=1e-2)."""
    from onnx_autodiff.cli import main

    source, out = tmp_path / "silero.onnx", tmp_path / "grad.onnx"
    onnx.save(models["silero"], source)
    assert main(["grad", str(source), "-o", str(out)]) == 0
    graded = onnx.load(out)
    names = [o.name for o in graded.graph.output]
    assert names[0] == "out" and set(names[1:]) == {f"grad_{w}" for w in WEIGHTS["silero"]}
    feeds = _feeds("silero")
    dy = np.random.default_rng(1).standard_normal((6, 2)).astype(np.float32)
    results = dict(zip(names, ort.InferenceSession(out.read_bytes()).run(None, {**feeds, "dy": dy})))
    assert not results["grad_lstm_w_8k"].any() and results["grad_lstm_w_16k"].any()
    base = next(n.attribute[0].t for a in models["silero"].graph.node[2].attribute for n in a.g.node
                if n.output[0] == "decoder_w")
    decoder = numpy_helper.to_array(base).astype(np.float64)

    def f(w):
        proto = onnx.ModelProto()
        proto.CopyFrom(models["silero"])
        for a in proto.graph.node[2].attribute:
            for n in a.g.node:
                if n.output[0] in ("decoder_w", "decoder_w_8k"):
                    n.attribute[0].t.CopyFrom(numpy_helper.from_array(w.astype(np.float32), n.output[0]))
        return float(np.sum(dy * ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]))

    h, fd = 1e-2, np.zeros_like(decoder)
    for i in np.ndindex(decoder.shape):
        step = np.zeros_like(decoder)
        step[i] = h
        fd[i] = (f(decoder + step) - f(decoder - step)) / (2 * h)
    np.testing.assert_allclose(results["grad_decoder_w"], fd, rtol=1e-2, atol=1e-3)


def test_running_statistics_stored_as_constants_are_updated_there(models):
    """Training-mode BatchNormalization (the opset-11 model converted for it) updates its running
    mean and variance, which the export writes into their Constant nodes; the exported model keeps
    the file's opset and structure. (The Conv's bias before it gets no gradient in training mode:
    the batch mean takes it out.)"""
    from onnx_autodiff.training import Trainer, generate_artifacts

    proto, feeds = models["paddle"], _feeds("paddle")
    target = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0] + 0.5
    artifacts = generate_artifacts(proto, loss="mse", optimizer="sgd", optimizer_options={"lr": 0.05})
    assert artifacts.layout["buffers"] == ["bn_mean", "bn_var"]
    trainer = Trainer(artifacts)
    trainer.step({**feeds, "labels": target})
    exported = trainer.export()
    before, after = _stored(proto.graph), _stored(exported.graph)
    assert {"bn_mean", "bn_var"} <= {k for k in before if not np.array_equal(before[k], after[k])}
    assert _structure(exported.graph) == _structure(proto.graph) and exported.opset_import == proto.opset_import
    ort.InferenceSession(exported.SerializeToString()).run(None, feeds)


def test_a_weight_in_a_loop_body_is_differentiated_and_trained():
    """A Constant weight inside a Loop body: an outer value the body reads once lifted, which the
    Loop rule differentiates; the export puts it back into the body."""
    from onnx_autodiff.training import Trainer, generate_artifacts

    body = helper.make_graph(
        [_const("loop_w", _normal(3, 3)), helper.make_node("MatMul", ["h", "loop_w"], ["hw"]),
         helper.make_node("Tanh", ["hw"], ["h_next"]), helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_next", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("Constant", [], ["n"], value=numpy_helper.from_array(np.array(3, np.int64))),
             helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("Loop", ["n", "t", "x"], ["y"], body=body)]
    graph = helper.make_graph(nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = ir.from_proto(proto)
    assert [v.name for v in default_parameters(model).parameters] == ["loop_w"]
    x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    assert_gradients(ir.to_proto(model), {"x": x}, ["loop_w"])
    trainer = Trainer(generate_artifacts(proto, loss="mse", optimizer="sgd", optimizer_options={"lr": 0.5}))
    losses = [trainer.step({"x": x, "labels": np.zeros((2, 3), np.float32)}) for _ in range(3)]
    assert losses[-1] < losses[0]
    exported = trainer.export()
    assert _structure(exported.graph) == _structure(proto.graph)
    assert not np.array_equal(_stored(exported.graph)["loop_w"], _stored(proto.graph)["loop_w"])


def test_train_command_writes_the_weights_into_their_constants(models, tmp_path):
    from onnx_autodiff.cli import main

    proto = models["paddle"]
    onnx.save(proto, tmp_path / "paddle.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((4, 2, 4, 4)).astype(np.float32), labels=rng.integers(0, 5, 4))
    assert main(["train", str(tmp_path / "paddle.onnx"), "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / "out"),
                 "--optimizer", "sgd", "--lr", "0.1", "--epochs", "2", "--batch-size", "2"]) == 0
    trained = onnx.load(tmp_path / "out" / "model.onnx")
    assert _structure(trained.graph) == _structure(proto.graph) and not trained.graph.initializer
    before, after = _stored(proto.graph), _stored(trained.graph)
    assert {k for k in before if not np.array_equal(before[k], after[k])} >= {"conv1_w", "conv2_w_flat", "fc_w", "fc_b16"}


def test_lora_on_a_constant_weight_merges_into_its_constant(models):
    """LoRA adapts the MatMul whose weight is a Constant node; export merges W + scale·A·B into
    that Constant (merge=False keeps the adapters beside it, the Constant unchanged)."""
    from onnx_autodiff.training.lora import LoraConfig
    from onnx_autodiff.training import Trainer, generate_artifacts

    proto, feeds = models["paddle"], _feeds("paddle")
    target = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)[0] + 0.5
    artifacts = generate_artifacts(proto, loss="mse", optimizer="sgd", optimizer_options={"lr": 0.5},
                                   lora=LoraConfig(rank=2), freeze_batchnorm=True)
    assert artifacts.params == ["fc_w.lora_A", "fc_w.lora_B"]
    trainer = Trainer(artifacts)
    losses = [trainer.step({**feeds, "labels": target}) for _ in range(3)]
    assert losses[-1] < losses[0]
    merged, apart = trainer.export(), trainer.export(merge=False)
    assert _structure(merged.graph) == _structure(proto.graph)
    before, after = _stored(proto.graph), _stored(merged.graph)
    assert {k for k in before if not np.array_equal(before[k], after[k])} == {"fc_w"}
    np.testing.assert_array_equal(_stored(apart.graph)["fc_w"], before["fc_w"])
    run = [ort.InferenceSession(m.SerializeToString()).run(None, feeds)[0] for m in (merged, apart)]
    np.testing.assert_allclose(run[0], run[1], rtol=1e-5, atol=1e-6)
    adapter_inputs = trainer.export_adapter_model()  # the base as an initializer, the adapters as inputs
    assert {"fc_w.lora_A", "fc_w.lora_B"} <= {i.name for i in adapter_inputs.graph.input}


def test_wrt_names_a_weight_inside_a_branch(models, tmp_path):
    """``--wrt`` takes a branch's Constant by the name ``params`` lists: it is lifted as the
    default's are, and its gradient equals the default build's for the same weight."""
    from onnx_autodiff.cli import main

    source = tmp_path / "silero.onnx"
    onnx.save(models["silero"], source)
    assert main(["grad", str(source), "-o", str(tmp_path / "all.onnx")]) == 0
    assert main(["grad", str(source), "-o", str(tmp_path / "one.onnx"), "--wrt", "lstm_w_16k", "decoder_w"]) == 0
    one = onnx.load(tmp_path / "one.onnx")
    assert [o.name for o in one.graph.output][1:] == ["grad_lstm_w_16k", "grad_decoder_w"]
    dy = np.random.default_rng(2).standard_normal((6, 2)).astype(np.float32)
    feeds = {**_feeds("silero"), "dy": dy}
    every = ort.InferenceSession(str(tmp_path / "all.onnx")).run(["grad_lstm_w_16k", "grad_decoder_w"], feeds)
    chosen = ort.InferenceSession(str(tmp_path / "one.onnx")).run(["grad_lstm_w_16k", "grad_decoder_w"], feeds)
    assert every[0].any()
    for a, b in zip(chosen, every):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert main(["grad", str(source), "-o", str(tmp_path / "no.onnx"), "--wrt", "no_such_weight"]) == 2
