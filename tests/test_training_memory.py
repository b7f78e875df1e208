"""The Trainer writes new parameters, optimiser state and buffers over the old ones when that is
safe, with results bit-equal to spare buffers, and a failed step still changes nothing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_training import batches, bn_dropout_model, mlp

from onnx_autodiff.training import Trainer, TrainingError, generate_artifacts
from onnx_autodiff.training import trainer as trainer_module
from onnx_autodiff.training.trainer import in_place_keys

OPTIMIZERS = [
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}),
    ("adam", {"lr": 0.01, "weight_decay": 0.01, "amsgrad": True}),
    ("adamw", {"lr": 0.01}),
]


def bn_model() -> onnx.ModelProto:
    """Gemm, BatchNormalization (running statistics carried as buffers), Gemm: no random op, so
    two trainers take bit-equal steps."""
    model = bn_dropout_model()
    dropout = next(n for n in model.graph.node if n.op_type == "Dropout")
    dropout.op_type, dropout.input[:] = "Identity", dropout.input[:1]
    return model


def snapshot(trainer: Trainer) -> dict[str, bytes]:
    return {key: value.tobytes() for key, value in trainer.state_dict().items()}


def with_spare_buffers(artifacts, monkeypatch) -> Trainer:
    """A trainer that writes every new value to a spare buffer (none in place)."""
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "in_place_keys", lambda proto, carry: set())
        trainer = Trainer(artifacts)
        if artifacts.apply_model is not None:  # runners are made when first used
            trainer._runner("accumulate"), trainer._runner("apply")
        return trainer


@pytest.mark.parametrize("name, options", OPTIMIZERS)
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_in_place_steps_equal_spare_buffer_steps(name, options, max_grad_norm, monkeypatch):
    artifacts = generate_artifacts(bn_model(), optimizer=name, optimizer_options=options,
                                   max_grad_norm=max_grad_norm, gradient_accumulation=True)
    in_place, spare = Trainer(artifacts), with_spare_buffers(artifacts, monkeypatch)
    data = list(batches(6))
    for trainer in (in_place, spare):
        for batch in data[:3]:
            trainer.step(batch)
        for batch in data[3:]:  # micro-batches, then one update
            trainer.accumulate(batch)
        trainer.apply()
    assert snapshot(in_place) == snapshot(spare)
    # every parameter, optimiser state and accumulator in place; the running statistics that
    # BatchNormalization returns get spare buffers (see _build_train)
    statistics = set(artifacts.layout["buffers"])
    assert statistics == {"mean", "var"}
    for kind in ("train", "accumulate", "apply"):
        runner = in_place._runner(kind)
        assert runner.in_place == {key for key, _, _ in runner.carry} - statistics, kind
        assert not spare._runner(kind).in_place
    # no spare buffer was ever made for a value written in place
    assert {key for key, pair in in_place._values.items() if pair[1] is not None} == statistics
    assert all(pair[1] is not None for pair in spare._values.values())


@pytest.mark.parametrize("name, options", OPTIMIZERS)
def test_failed_in_place_step_changes_nothing(name, options):
    trainer = Trainer(generate_artifacts(bn_model(), optimizer=name, optimizer_options=options))
    for batch in batches(2):
        trainer.step(batch)
    before = snapshot(trainer)
    X, y = next(batches(1, seed=9))
    X[1, 2] = np.inf
    with pytest.raises(TrainingError, match="step 3: the loss is nan"):
        trainer.step((X, y))
    assert snapshot(trainer) == before  # parameters, optimiser state and running statistics


def graph_with(nodes, outputs) -> onnx.ModelProto:
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [value("p", TensorProto.FLOAT, [3])],
                              [value(name, TensorProto.FLOAT, [3]) for name in outputs])
    return helper.make_model(graph)


def test_in_place_needs_every_reader_of_the_old_value_to_run_before_the_writer():
    carry = [("p", "p", "p.new")]
    # p.new = p + 2p: its writer depends on every reader of p
    safe = graph_with([helper.make_node("Add", ["p", "p"], ["twice"]),
                       helper.make_node("Add", ["p", "twice"], ["p.new"])], ["p.new"])
    assert in_place_keys(safe, carry) == {"p"}
    # another output reads p but the writer does not wait for it: p.new might overwrite p first
    unordered = graph_with([helper.make_node("Neg", ["p"], ["y"]),
                            helper.make_node("Add", ["p", "p"], ["p.new"])], ["y", "p.new"])
    assert in_place_keys(unordered, carry) == set()
    # a writer that is not elementwise reads other positions than it writes
    softmax = graph_with([helper.make_node("Softmax", ["p"], ["p.new"])], ["p.new"])
    assert in_place_keys(softmax, carry) == set()


def test_artifacts_without_the_kept_flag_use_spare_buffers():
    """Artifacts saved before the models carried their own "kept" flag still train, the old way."""
    artifacts = generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.01})
    old = generate_artifacts(mlp(), optimizer="adam", optimizer_options={"lr": 0.01})
    flag = old.layout["train"].pop("kept")
    outputs = [o for o in old.train_model.graph.output if o.name != flag]
    del old.train_model.graph.output[:]
    old.train_model.graph.output.extend(outputs)
    new_trainer, old_trainer = Trainer(artifacts), Trainer(old)
    assert not old_trainer._runner("train").in_place
    for batch in batches(3):
        assert new_trainer.step(batch) == old_trainer.step(batch)
    assert snapshot(new_trainer) == snapshot(old_trainer)


def if_graph(then_nodes, else_nodes, outer=(), outputs=()) -> onnx.ModelProto:
    """p.new = If(k) of branches returning "t" and "e", after ``outer`` nodes; ``outputs``: more
    graph outputs."""
    value = helper.make_tensor_value_info
    then_branch = helper.make_graph(then_nodes, "then", [], [value("t", TensorProto.FLOAT, [3])])
    else_branch = helper.make_graph(else_nodes, "else", [], [value("e", TensorProto.FLOAT, [3])])
    nodes = [*outer, helper.make_node("If", ["k"], ["p.new"], then_branch=then_branch, else_branch=else_branch)]
    graph = helper.make_graph(nodes, "g", [value("p", TensorProto.FLOAT, [3]), value("k", TensorProto.BOOL, [])],
                              [value(name, TensorProto.FLOAT, [3]) for name in ("p.new", *outputs)])
    return helper.make_model(graph)


def test_in_place_through_an_if_needs_each_branch_to_write_in_place():
    carry = [("p", "p", "p.new")]
    keep = [helper.make_node("Identity", ["p"], ["e"])]
    # then: t = p + 2p; else: the old value
    update = [helper.make_node("Add", ["p", "p"], ["twice"]), helper.make_node("Add", ["p", "twice"], ["t"])]
    assert in_place_keys(if_graph(update, keep), carry) == {"p"}
    # a branch whose writer is not elementwise
    softmax = [helper.make_node("Softmax", ["p"], ["t"])]
    assert in_place_keys(if_graph(softmax, keep), carry) == set()
    # a branch reading p in a node the writer does not wait for
    unordered = [helper.make_node("Neg", ["p"], ["unused"]), helper.make_node("Add", ["p", "p"], ["t"])]
    assert in_place_keys(if_graph(unordered, keep), carry) == set()
    # a reader of p outside the If that the If does not wait for
    outside = [helper.make_node("Neg", ["p"], ["y"])]
    assert in_place_keys(if_graph(update, keep, outer=outside, outputs=["y"]), carry) == set()


def test_update_is_one_if_on_the_kept_flag():
    """No gate per gradient (a Where over each, slow on onnxruntime): the flag is read by one If,
    which returns every new value, and is the last node to run."""
    artifacts = generate_artifacts(mlp(), optimizer="adamw", max_grad_norm=1.0, gradient_accumulation=True)
    for kind in ("train", "accumulate", "apply"):
        graph = getattr(artifacts, f"{kind}_model").graph
        layout = artifacts.layout[kind]
        readers = [node for node in graph.node if layout["kept"] in node.input]
        assert [node.op_type for node in readers] == ["If"], kind
        assert {out for _, _, out in layout["carry"]} == set(readers[0].output), kind
        assert graph.node[-1] is readers[0], kind
