"""No float64 in the artifacts of a float32 model: onnxruntime-web's builds have reduced kernel
type lists, and a Cast to float64 fails session creation there (WASM: "Could not find an
implementation for Cast(19)"; WebGPU: "Provider type for Cast node ... is not set"). The per-step
coefficients that Adam's bias corrections and AdamW's decay need are computed by the runner in
float64 and fed as scalars of the parameters' precision (layout "coefficients"), with the numbers
the graph computed before (bit for bit; tests/test_training.py checks them against torch.optim).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, TensorProto
from test_training import batches, bn_dropout_model, float64, mlp

from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training import Trainer, TrainingArtifacts, TrainingError, generate_artifacts
from onnx_autodiff.training.optimizers import AdamW, coefficient_formulas, evaluate_coefficient

MODELS = ("train_model", "eval_model", "inference_model", "accumulate_model", "apply_model")

OPTIMIZERS = {
    "sgd": ("sgd", {"lr": 0.1}),
    "sgd-nesterov-wd": ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd-dampening-wd": ("sgd", {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1}),
    "adam-wd": ("adam", {"lr": 0.01, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    "adam-amsgrad": ("adam", {"lr": 0.01, "amsgrad": True}),
    "adamw": ("adamw", {"lr": 0.01, "weight_decay": 0.3}),
    "adamw-amsgrad": ("adamw", {"lr": 0.01, "amsgrad": True}),
}


def _double_type(t: onnx.TypeProto) -> bool:
    which = t.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        return getattr(t, which).elem_type == TensorProto.DOUBLE
    if which in ("sequence_type", "optional_type"):
        return _double_type(getattr(t, which).elem_type)
    if which == "map_type":
        return _double_type(t.map_type.value_type)
    return False


def double_uses(model: onnx.ModelProto) -> list[str]:
    """Where ``model`` holds float64: inputs, outputs, value_info (after shape inference, so every
    intermediate value is typed), initializers, Constant and other tensor attributes, ``to`` and
    ``dtype`` attributes, subgraphs (the update's If branches) and local functions."""
    found: list[str] = []

    def nodes(nodes, where):
        for node in nodes:
            for a in node.attribute:
                here = f"{where}{node.op_type} '{node.name}' attribute {a.name}"
                if a.type == AttributeProto.INT and a.name in ("to", "dtype", "output_dtype") and a.i == TensorProto.DOUBLE:
                    found.append(here)
                elif a.type == AttributeProto.TENSOR and a.t.data_type == TensorProto.DOUBLE:
                    found.append(here)
                elif a.type == AttributeProto.TENSORS and any(t.data_type == TensorProto.DOUBLE for t in a.tensors):
                    found.append(here)
                elif a.type == AttributeProto.SPARSE_TENSOR and a.sparse_tensor.values.data_type == TensorProto.DOUBLE:
                    found.append(here)
                elif a.type == AttributeProto.TYPE_PROTO and _double_type(a.tp):
                    found.append(here)
                elif a.type == AttributeProto.GRAPH:
                    graph(a.g, f"{here} > ")
                elif a.type == AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        graph(sub, f"{here} > ")

    def graph(g: onnx.GraphProto, where: str):
        for kind in ("input", "output", "value_info"):
            found.extend(f"{where}{kind} '{v.name}'" for v in getattr(g, kind) if _double_type(v.type))
        found.extend(f"{where}initializer '{t.name}'" for t in g.initializer if t.data_type == TensorProto.DOUBLE)
        found.extend(f"{where}sparse initializer '{t.values.name}'" for t in g.sparse_initializer
                     if t.values.data_type == TensorProto.DOUBLE)
        nodes(g.node, where)

    graph(onnx.shape_inference.infer_shapes(model, strict_mode=True).graph, "")
    for function in model.functions:
        nodes(function.node, f"function {function.name}: ")
    return found


def bn_model() -> onnx.ModelProto:
    """Gemm, BatchNormalization in training mode (running statistics as buffers), Dropout, Gemm."""
    return bn_dropout_model()


def test_double_uses_finds_float64():
    """The check itself: a float64 model's artifacts are float64 throughout."""
    artifacts = generate_artifacts(float64(mlp()), optimizer="adamw", gradient_accumulation=True)
    found = double_uses(artifacts.train_model)
    assert any(f.startswith("input 'W1'") for f in found) and any("then_branch" in f for f in found)


@pytest.mark.parametrize("model", ["mlp", "batchnorm"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_float32_artifacts_hold_no_float64(optimizer, model):
    """Every optimiser, with and without clipping, accumulation and LoRA, on an MLP and on a
    model with BatchNormalization (training mode) and Dropout: no float64 in any model, and a step
    (or two micro-batches and an apply) runs."""
    name, options = OPTIMIZERS[optimizer]
    make = {"mlp": mlp, "batchnorm": bn_model}[model]
    X, y = next(batches(1))
    for max_grad_norm, accumulation, lora in itertools.product((None, 1.0), (False, True), (None, LoraConfig(rank=2))):
        what = f"max_grad_norm={max_grad_norm}, gradient_accumulation={accumulation}, lora={lora is not None}"
        artifacts = generate_artifacts(make(), optimizer=name, optimizer_options=options, max_grad_norm=max_grad_norm,
                                       gradient_accumulation=accumulation, lora=lora)
        for attribute in MODELS:
            proto = getattr(artifacts, attribute)
            if proto is not None:
                assert double_uses(proto) == [], f"{attribute} ({what})"
        for kind in ("train", "apply") if accumulation else ("train",):
            layout = artifacts.layout[kind]
            assert set(layout.get("coefficients", {})) == set(coefficient_formulas(artifacts.optimizer)), what
            assert set(layout.get("coefficients", {})) <= set(layout["scalars"]), what
        trainer = Trainer(artifacts)
        before = trainer.parameters()
        assert np.isfinite(trainer.step((X, y)))
        if accumulation:
            trainer.accumulate((X[:3], y[:3]))
            trainer.accumulate((X[3:], y[3:]))
            trainer.apply()
        assert trainer.step_count == (2 if accumulation else 1), what
        after = trainer.parameters()
        assert any(not np.array_equal(before[k], after[k]) for k in before), what


def test_float64_model_trains_in_float64():
    """A float64 model keeps float64 (its coefficients are float64 inputs) and trains: the
    accumulated steps equal whole-batch steps to float64 precision."""
    artifacts = generate_artifacts(float64(mlp()), optimizer="adamw", optimizer_options={"lr": 0.01, "amsgrad": True},
                                   gradient_accumulation=True, max_grad_norm=1.0)
    inputs = {v.name: v.type.tensor_type.elem_type for v in artifacts.train_model.graph.input}
    for key in ("step_size", "eps_scaled", "decay"):
        assert inputs[artifacts.layout["train"]["scalars"][key]] == TensorProto.DOUBLE
    big, accumulated = Trainer(artifacts), Trainer(artifacts)
    losses = []
    for X, y in batches(3):
        X = X.astype(np.float64)
        losses.append(big.step((X, y)))
        accumulated.accumulate((X[:3], y[:3]))
        accumulated.accumulate((X[3:], y[3:]))
        accumulated.apply()
    assert all(np.isfinite(losses)) and big.step_count == accumulated.step_count == 3
    ours, theirs = big.parameters(), accumulated.parameters()
    for key, value in ours.items():
        assert value.dtype == np.float64
        np.testing.assert_allclose(theirs[key], value, rtol=1e-12, atol=1e-15, err_msg=key)


def test_mixed_precision_parameters_cast_float32_coefficients():
    """float16 parameters beside float32 ones read the float32 coefficients through a Cast (as the
    graph's float64 values were cast before: onnxruntime casts double to float16 through float)."""
    model = mlp()
    for tensor in model.graph.initializer:
        if tensor.name in ("W2", "b2"):
            tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    gemm = model.graph.node[2]
    gemm.input[1:3] = ["W2f", "b2f"]
    model.graph.node.insert(2, onnx.helper.make_node("Cast", ["W2"], ["W2f"], to=TensorProto.FLOAT))
    model.graph.node.insert(3, onnx.helper.make_node("Cast", ["b2"], ["b2f"], to=TensorProto.FLOAT))
    artifacts = generate_artifacts(model, optimizer="adam", optimizer_options={"lr": 0.01})
    assert double_uses(artifacts.train_model) == []
    trainer = Trainer(artifacts)
    for batch in batches(2):
        assert np.isfinite(trainer.step(batch))
    assert trainer.parameters()["W2"].dtype == np.float16


def test_coefficients_are_torch_arithmetic():
    """The layout's expressions compute what torch.optim.Adam(W) computes in Python floats, from lr
    as the float32 lr input holds it; they survive artifacts.json (JSON numbers are exact)."""
    spec = AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    formulas = json.loads(json.dumps(coefficient_formulas(spec)))
    lr = float(np.float32(1e-3))
    for step in (1, 2, 10, 1000, 123457):
        bc1, bc2 = 1 - 0.9 ** step, 1 - 0.999 ** step
        values = {"lr": 1e-3, "step": step}
        assert evaluate_coefficient(formulas["step_size"], values) == lr * bc2 ** 0.5 / bc1
        assert evaluate_coefficient(formulas["eps_scaled"], values) == bc2 ** 0.5 * 1e-8
        assert evaluate_coefficient(formulas["decay"], values) == 1 - lr * 0.01
    with pytest.raises(TrainingError, match="unknown coefficient expression"):
        evaluate_coefficient(["cbrt", 2.0], {})


def test_older_format_loads_and_an_unknown_one_is_refused(tmp_path):
    """Format 1 (the coefficients computed in the graph) still loads and trains; a format this
    version does not know gives a clear error."""
    directory = tmp_path / "artifacts"
    generate_artifacts(mlp(), optimizer="sgd", optimizer_options={"lr": 0.1, "momentum": 0.9}).save(directory)
    path = directory / "artifacts.json"
    layout = json.loads(path.read_text())
    assert layout["format"] == 2
    path.write_text(json.dumps({**layout, "format": 1}))  # SGD's models are the same in both formats
    trainer = Trainer(str(directory))
    assert np.isfinite(trainer.step(next(batches(1))))
    path.write_text(json.dumps({**layout, "format": 99}))
    with pytest.raises(TrainingError, match=r"unsupported artifacts format 99 \(this version of onnx-autodiff reads formats 1, 2, 3\)"):
        TrainingArtifacts.load(directory)


@pytest.mark.parametrize("target", ["onnxruntime", "webgpu"])
def test_artifacts_that_feed_the_step_to_a_hashed_dropout_say_format_3(tmp_path, target):
    """The webgpu target's Dropout reads the step and micro-batch as uint32 inputs, which a
    trainer of format 2 would not feed: only those artifacts say 3 (the rest stay readable by it),
    and they load and train here."""
    artifacts = generate_artifacts(bn_dropout_model(), optimizer="sgd", target=target)
    artifacts.save(tmp_path / "artifacts")
    layout = json.loads((tmp_path / "artifacts" / "artifacts.json").read_text())
    assert layout["format"] == (3 if target == "webgpu" else 2)
    assert ("dropout_step" in layout["train"].get("coefficients", {})) == (target == "webgpu")
    trainer = Trainer(str(tmp_path / "artifacts"), providers=["CPUExecutionProvider"])
    assert np.isfinite(trainer.step(next(batches(1))))
