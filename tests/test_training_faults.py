"""A bad batch or checkpoint loses no training state: non-finite steps, empty batches, NaN checkpoints."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from test_training import BATCH, IN, OUT, batches, mlp

from onnx_autodiff.training import BatchError, Trainer, TrainingError, generate_artifacts
from onnx_autodiff.training.runner import _with_finite_flag


def snapshot(trainer: Trainer) -> dict[str, bytes]:
    """Every parameter, optimiser state and buffer, bit for bit."""
    return {key: value.tobytes() for key, value in trainer.state_dict().items()}


def nan_batch(seed=5):
    X, y = next(batches(1, seed=seed))
    X[2, 3] = np.nan
    return X, y


def sqrt_loss(op, y, t):
    """sum(sqrt(t * y²)): finite (0) for t = 0, but its gradient t·y / sqrt(t·y²) is 0/0 = NaN."""
    return op.ReduceSum(op.Sqrt(op.Mul(t, op.Mul(y, y))), keepdims=0)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_nan_batch_raises_naming_the_step_and_changes_nothing(max_grad_norm):
    trainer = Trainer(generate_artifacts(mlp(), optimizer="adamw", optimizer_options={"lr": 0.01}, max_grad_norm=max_grad_norm))
    for X, y in batches(2):
        trainer.step((X, y))
    before = snapshot(trainer)
    with pytest.raises(TrainingError, match="step 3: the loss is nan; batch input 'X' holds NaN or Inf. Nothing was updated"):
        trainer.step(nan_batch())
    assert snapshot(trainer) == before and trainer.step_count == 2
    # the next good step is the one an untouched trainer takes
    reference = Trainer(trainer.artifacts)
    for X, y in batches(2):
        reference.step((X, y))
    X, y = next(batches(1, seed=7))
    assert trainer.step((X, y)) == reference.step((X, y))
    assert snapshot(trainer) == snapshot(reference)


def test_finite_loss_with_nan_gradients_raises():
    trainer = Trainer(generate_artifacts(mlp(), loss=sqrt_loss, optimizer="adam", optimizer_options={"lr": 0.01}))
    X, _ = next(batches(1))
    trainer.step((X, np.ones((BATCH, OUT), np.float32)))
    before = snapshot(trainer)
    with pytest.raises(TrainingError, match="step 2: the loss is 0 but a gradient .* is NaN or Inf"):
        trainer.step((X, np.zeros((BATCH, OUT), np.float32)))
    assert snapshot(trainer) == before


def test_skip_mode_counts_skipped_steps_and_keeps_state():
    artifacts = generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.01})
    skipping, reference = Trainer(artifacts, nonfinite="skip"), Trainer(artifacts)
    good = list(batches(3))
    skipping.step(good[0])
    before = snapshot(skipping)
    assert np.isnan(skipping.step(nan_batch()))
    assert skipping.skipped_steps == 1 and skipping.step_count == 1
    assert snapshot(skipping) == before
    for batch in good[1:]:
        skipping.step(batch)
    for batch in good:
        reference.step(batch)
    assert skipping.skipped_steps == 1 and skipping.step_count == 3
    assert snapshot(skipping) == snapshot(reference)
    with pytest.raises(TrainingError, match="nonfinite must be 'raise' or 'skip', not 'ignore'"):
        Trainer(artifacts, nonfinite="ignore")


def test_accumulation_raises_or_skips_the_whole_step():
    artifacts = generate_artifacts(mlp(), optimizer="adamw", optimizer_options={"lr": 0.01}, gradient_accumulation=True)
    X, y = next(batches(1))
    raising, skipping, reference = Trainer(artifacts), Trainer(artifacts, nonfinite="skip"), Trainer(artifacts)
    raising.accumulate((X[:3], y[:3]))
    with pytest.raises(TrainingError, match="micro-batch 2 of step 1: the loss is nan; batch input 'X'"):
        raising.accumulate(nan_batch())
    raising.accumulate((X[3:], y[3:]))  # the bad micro-batch left the accumulated gradients as they were
    raising.apply()
    reference.accumulate((X[:3], y[:3]))
    reference.accumulate((X[3:], y[3:]))
    reference.apply()
    assert snapshot(raising) == snapshot(reference)
    before = snapshot(skipping)
    skipping.accumulate((X[:3], y[:3]))
    assert np.isnan(skipping.accumulate(nan_batch()))
    skipping.apply()
    assert skipping.skipped_steps == 1 and skipping.step_count == 0
    assert snapshot(skipping) == before


def test_empty_batch_is_a_batch_error():
    assert issubclass(BatchError, TrainingError)
    trainer = Trainer(generate_artifacts(mlp(), optimizer="adam"))
    X, y = next(batches(1))
    before = snapshot(trainer)
    empty = r"batch input 'X' has shape \(0, 5\): the batch is empty; the train model needs at least one example"
    with pytest.raises(BatchError, match=empty):
        trainer.step((X[:0], y[:0]))
    with pytest.raises(BatchError, match="the eval model needs at least one example"):
        trainer.evaluate((X[:0], y[:0]))
    assert snapshot(trainer) == before and trainer.step_count == 0


def test_checkpoint_holding_nan_is_refused(tmp_path):
    artifacts = generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.01})
    trainer = Trainer(artifacts)
    trainer.step(next(batches(1)))
    before = snapshot(trainer)
    state = trainer.state_dict()
    state["W1"] = state["W1"] * 0.5  # a valid change before the bad value: it must not be loaded either
    state["b2.exp_avg_sq"][1] = np.nan
    np.savez(tmp_path / "bad.npz", **state)
    with pytest.raises(TrainingError, match=r"checkpoint value 'b2.exp_avg_sq' holds 1 NaN or Inf of its 3 values: refusing"):
        trainer.load_checkpoint(tmp_path / "bad.npz")
    assert snapshot(trainer) == before
    state["b2.exp_avg_sq"][1] = np.inf
    with pytest.raises(TrainingError, match="'b2.exp_avg_sq' holds 1 NaN or Inf"):
        Trainer(artifacts, checkpoint=state)


def test_state_dict_is_a_copy_later_steps_leave_alone():
    trainer = Trainer(generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.01}))
    good = list(batches(3))
    trainer.step(good[0])
    kept = trainer.state_dict()
    bits = {key: value.tobytes() for key, value in kept.items()}
    parameters = trainer.parameters()
    parameters["W1"][:] = np.nan  # changing a returned array must not reach the trainer
    for batch in good[1:]:
        trainer.step(batch)
    assert {key: value.tobytes() for key, value in kept.items()} == bits
    assert np.isfinite(trainer.parameters()["W1"]).all()


@pytest.mark.parametrize("dtype", [onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16])
def test_finite_check_graph_is_valid(dtype):
    """The check appended to a step model passes the checker and trips on one NaN or Inf."""
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", dtype, [2, IN])], [onnx.helper.make_tensor_value_info("y", dtype, [2, IN])])
    serialised, flag = _with_finite_flag(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), ["y"])
    model = onnx.load_from_string(serialised)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    import onnxruntime as ort

    session = ort.InferenceSession(serialised, providers=["CPUExecutionProvider"])
    x = np.linspace(-3, 5, 2 * IN).reshape(2, IN).astype(np_type)
    assert session.run([flag], {"x": x})[0] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-3)
    for bad in (np.nan, np.inf, -np.inf):
        x[1, 2] = bad
        assert not np.isfinite(session.run([flag], {"x": x})[0])


def test_finite_values_whose_sum_overflows_are_kept():
    """The in-graph check sums the new values; when that sum overflows, the values themselves decide."""
    big = numpy_helper.from_array(np.full(4, 3e38, np.float32), "big")
    one = helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.ones((), np.float32)))
    own = mlp(extra_nodes=[one, helper.make_node("Min", ["big", "one"], ["ones"]),
                           helper.make_node("ReduceSum", ["ones"], ["unused"], keepdims=0),
                           helper.make_node("ReduceSumSquare", ["logits"], ["square"], keepdims=0),
                           helper.make_node("Add", ["square", "unused"], ["total"])],
              extra_inits=[big])
    own.graph.output.append(helper.make_tensor_value_info("total", onnx.TensorProto.FLOAT, []))
    trainer = Trainer(generate_artifacts(own, loss=None, output="total", requires_grad=["W1", "b1", "W2", "b2", "big"],
                                         optimizer="sgd", optimizer_options={"lr": 0.01}))
    assert np.isfinite(trainer.step({"X": next(batches(1))[0]}))
    assert trainer.step_count == 1
    assert not np.array_equal(trainer.parameters()["W1"], numpy_helper.to_array(own.graph.initializer[0]))
