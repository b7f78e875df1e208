"""The Trainer writes new parameters, optimiser state and buffers over the old ones when that is
safe, with results bit-equal to spare buffers, and a failed step still changes nothing; large
frozen weights are read where they are stored and held once."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_training import batches, bn_dropout_model, mlp

from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training import Trainer, TrainingError, generate_artifacts
from onnx_autodiff.training.generation import frozen_reads
from onnx_autodiff.training.in_place import in_place_keys

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


def with_spare_buffers(artifacts) -> Trainer:
    """A trainer that writes every new value to a spare buffer (none in place): the manifest's
    signatures record no key as written in place."""
    manifest = artifacts.manifest
    steps = {kind: dataclasses.replace(manifest.signature(kind), in_place=())
             for kind in ("train", "accumulate", "apply") if manifest.signature(kind) is not None}
    return Trainer(dataclasses.replace(artifacts, manifest=dataclasses.replace(manifest, **steps)))


@pytest.mark.parametrize("name, options", OPTIMIZERS)
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_in_place_steps_equal_spare_buffer_steps(name, options, max_grad_norm):
    artifacts = generate_artifacts(bn_model(), optimizer=name, optimizer_options=options,
                                   max_grad_norm=max_grad_norm, gradient_accumulation=True)
    in_place, spare = Trainer(artifacts), with_spare_buffers(artifacts)
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
        runner = in_place.steps.runner(kind)
        assert runner.in_place == {key for key, _, _ in runner.carry} - statistics, kind
        assert not spare.steps.runner(kind).in_place
    # no spare buffer was ever made for a value written in place
    assert {key for key, pair in in_place.state._pairs.items() if pair[1] is not None} == statistics
    assert all(pair[1] is not None for pair in spare.state._pairs.values())


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
    flag = old.manifest.train.kept
    old.manifest = dataclasses.replace(old.manifest, train=dataclasses.replace(old.manifest.train, kept=None))
    outputs = [o for o in old.train_model.graph.output if o.name != flag]
    del old.train_model.graph.output[:]
    old.train_model.graph.output.extend(outputs)
    new_trainer, old_trainer = Trainer(artifacts), Trainer(old)
    assert not old_trainer.steps.runner("train").in_place
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
    which returns every new value, a group's joined, and runs after every other node but the
    Splits of those groups (and the Constants of their sizes)."""
    artifacts = generate_artifacts(mlp(), optimizer="adamw", max_grad_norm=1.0, gradient_accumulation=True)
    for kind in ("train", "accumulate", "apply"):
        graph = getattr(artifacts, f"{kind}_model").graph
        layout = artifacts.layout[kind]
        readers = [node for node in graph.node if layout["kept"] in node.input]
        assert [node.op_type for node in readers] == ["If"], kind
        returned = set(readers[0].output)
        after = [node for node in list(graph.node)[list(graph.node).index(readers[0]) + 1:] if node.op_type != "Constant"]
        assert after and all(node.op_type == "Split" and node.input[0] in returned for node in after), kind
        split = {out for node in after for out in node.output}
        carried = {out for _, _, out in layout["carry"]}
        assert carried <= returned | split and carried & split, kind


# large frozen weights: read where they are stored, held once

WIDTHS = (64, 256, 384, 4)  # the 384x256 weight (384 KiB) is over FROZEN_IN_PLACE, the others under it


def linear_model(lead) -> onnx.ModelProto:
    """X[*lead, 64] -> three layers MatMul(x, Transpose(W)) as torch exports nn.Linear (W [out, in]),
    Relu between them -> logits[*lead, 4]."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "X"
    for i, (fan_in, fan_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        weight = (rng.standard_normal((fan_out, fan_in)) * fan_in**-0.5).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"W{i}"))
        last = i == len(WIDTHS) - 2
        nodes += [helper.make_node("Transpose", [f"W{i}"], [f"W{i}.T"], perm=[1, 0]),
                  helper.make_node("MatMul", [x, f"W{i}.T"], ["logits" if last else f"h{i}"])]
        if not last:
            nodes.append(helper.make_node("Relu", [f"h{i}"], [f"a{i}"]))
            x = f"a{i}"
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [*lead, WIDTHS[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*lead, WIDTHS[-1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def linear_batch(lead, seed=2):
    rng = np.random.default_rng(seed)
    shape = [d if isinstance(d, int) else 3 for d in lead]
    return {"X": rng.standard_normal((*shape, WIDTHS[0])).astype(np.float32),
            "labels": rng.standard_normal((*shape, WIDTHS[-1])).astype(np.float32)}


def readers(model: onnx.ModelProto, name: str) -> list[str]:
    return sorted(node.op_type for node in model.graph.node if name in node.input)


@pytest.mark.parametrize("lead", [["N", "S"], [2, 3]], ids=["symbolic", "static"])
def test_large_frozen_weights_are_read_in_place_and_held_once(lead, tmp_path, monkeypatch):
    """A frozen weight over FROZEN_IN_PLACE is never a Transpose's input (onnxruntime would fold it
    into a transposed copy): a Gemm reads it transposed, x flattened to rows and back; the trainer
    maps it once for its sessions, none of which pre-packs it; the steps are the same."""
    path = str(tmp_path / "linear.onnx")
    onnx.save_model(linear_model(lead), path, save_as_external_data=True, location="weights.bin", size_threshold=1024)
    options = {"loss": "mse", "optimizer": "adamw", "optimizer_options": {"lr": 0.01}, "lora": LoraConfig(rank=2)}
    artifacts = generate_artifacts(path, **options)
    # the forward's Gemm, and the backward's MatMul(dY, W1) for the adapters of W0 before it
    assert readers(artifacts.train_model, "W1") == ["Gemm", "MatMul"]
    assert readers(artifacts.eval_model, "W1") == ["Gemm"]
    gemm = next(n for n in artifacts.eval_model.graph.node if n.op_type == "Gemm" and "W1" in n.input)
    assert helper.get_attribute_value(next(a for a in gemm.attribute if a.name == "transB")) == 1
    for small in ("W0", "W2"):  # under the threshold: as torch wrote them
        assert readers(artifacts.eval_model, small) == ["Transpose"]
    with monkeypatch.context() as patch:
        patch.setattr(frozen_reads, "FROZEN_IN_PLACE", 1 << 40)
        transposed = generate_artifacts(path, **options)
    assert readers(transposed.eval_model, "W1") == ["Transpose"]
    trainer, reference = Trainer(artifacts), Trainer(transposed)
    assert sorted(trainer.sessions.frozen) == ["W1"]  # mapped from weights.bin, shared by the sessions
    assert trainer.session_options.get_session_config_entry("session.disable_prepacking") == "1"
    batch = linear_batch(lead)
    losses = [(trainer.step(batch), reference.step(batch)) for _ in range(4)]
    np.testing.assert_allclose(*zip(*losses), rtol=1e-6)
    assert losses[-1][0] < losses[0][0]
    np.testing.assert_allclose(trainer.evaluate(batch)["logits"], reference.evaluate(batch)["logits"], rtol=1e-5, atol=1e-6)
    # with session options of one's own, the sessions read the weights as onnxruntime does
    own = Trainer(artifacts, session_options=ort.SessionOptions())
    assert own.sessions.frozen == {}
    assert own.step(batch) == pytest.approx(losses[0][0], rel=1e-6)



def _stored_alone_prefix(model: onnx.ModelProto) -> set[str]:
    """The outputs of the nodes of ``model`` before the first one that reads a batch input."""
    fed = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    prefix = set()
    for node in model.graph.node:
        if any(name in fed for name in node.input):
            return prefix
        prefix.update(node.output)
    return prefix


def _float_initializer_sizes(model_path: str, folder: str) -> list[int]:
    """The element counts of the float32 initializers onnxruntime holds once it created a session of
    the model (its optimised graph, constants folded)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(folder / "optimized.onnx"), load_external_data=False)
    return [int(np.prod(t.dims)) for t in optimized.graph.initializer if t.data_type == TensorProto.FLOAT]


@pytest.mark.parametrize("kind", ["float16", "int8"])
def test_frozen_bases_of_other_types_become_floats_where_each_node_reads_them(kind, tmp_path, monkeypatch):
    """A frozen base weight stored as float16 (read through Cast) or int8 (DequantizeLinear) whose
    floats are over FROZEN_IN_PLACE: onnxruntime folds no float copy of it when it creates the
    session (the Cast's weight is an overridable input), each node reading the Cast has a Cast of
    its own that common-subexpression elimination cannot merge, and the reads come first in the
    graph; the steps are those of the artifacts written without this."""
    path = str(tmp_path / "linear.onnx")
    onnx.save_model(linear_model([2, 3]), path, save_as_external_data=True, location="weights.bin", size_threshold=1024)
    options = {"loss": "mse", "optimizer": "adamw", "optimizer_options": {"lr": 0.01},
               "lora": LoraConfig(rank=2, quantize_base=kind)}
    artifacts = generate_artifacts(path, **options)
    with monkeypatch.context() as patch:
        patch.setattr(frozen_reads, "_frozen_bases_read_at_use", lambda model: None)
        as_written = generate_artifacts(path, **options)
    model, read = artifacts.train_model, "Cast" if kind == "float16" else "DequantizeLinear"
    reads = [n for n in model.graph.node if n.op_type == read and n.input[0] in ("W1", *(o for m in model.graph.node
             if m.op_type == "Reshape" and m.input[0] == "W1" for o in m.output))]
    assert len(reads) == (2 if kind == "float16" else 1)  # the forward's and the backward's reads
    first = _stored_alone_prefix(model)
    assert all(n.output[0] in first for n in reads)
    if kind == "float16":
        assert "W1" in [i.name for i in model.graph.input]  # overridable: onnxruntime does not fold it
        assert len({tuple(n.input) for n in reads}) == 2  # two different reads of W1
    weight = 384 * 256
    for proto, folded in ((artifacts, False), (as_written, kind == "float16")):
        directory = tmp_path / f"{kind}-{folded}"
        proto.save(directory)
        sizes = _float_initializer_sizes(str(directory / "training_model.onnx"), directory)
        assert (weight in sizes) == folded
    trainer, reference = Trainer(artifacts), Trainer(as_written)
    batch = linear_batch([2, 3])
    losses = [(trainer.step(batch), reference.step(batch)) for _ in range(4)]
    assert [a for a, _ in losses] == [b for _, b in losses]
    assert losses[-1][0] < losses[0][0]

def test_a_matmulnbits_backwards_unpacking_runs_where_its_layer_is_reached(tmp_path, monkeypatch):
    """The nodes that unpack a MatMulNBits weight for the backward depend on stored weights alone:
    they come first in the train model, where onnxruntime's order runs them just before the
    product that reads them (left after the activations they meet, they would all run before the
    loss's gradient); the steps are those of the model as the cleanup left it."""
    path = str(tmp_path / "linear.onnx")
    onnx.save_model(linear_model([2, 3]), path, save_as_external_data=True, location="weights.bin", size_threshold=1024)
    options = {"loss": "mse", "optimizer": "adamw", "optimizer_options": {"lr": 0.01},
               "lora": LoraConfig(rank=2, quantize_base="int4", quantize_format="matmulnbits")}
    artifacts = generate_artifacts(path, **options)
    with monkeypatch.context() as patch:
        patch.setattr(frozen_reads, "_stored_alone_first", lambda graph: None)
        as_cleaned = generate_artifacts(path, **options)
    model = artifacts.train_model
    packed = {n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"}
    unpacking = [n for n in model.graph.node if n.op_type != "MatMulNBits" and packed & set(n.input)]
    assert unpacking and all(n.output[0] in _stored_alone_prefix(model) for n in unpacking)
    late = [n for n in as_cleaned.train_model.graph.node if n.op_type != "MatMulNBits" and packed & set(n.input)]
    assert not all(n.output[0] in _stored_alone_prefix(as_cleaned.train_model) for n in late)
    trainer, reference = Trainer(artifacts), Trainer(as_cleaned)
    batch = linear_batch([2, 3])
    losses = [(trainer.step(batch), reference.step(batch)) for _ in range(4)]
    assert [a for a, _ in losses] == [b for _, b in losses]
    assert losses[-1][0] < losses[0][0]


def folded_linear_model(lead) -> onnx.ModelProto:
    """linear_model with each weight stored transposed, W [in, out], read by MatMul(x, W) as an
    exporter that folds constants writes it."""
    model = linear_model(lead)
    graph = model.graph
    for tensor in graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).T.copy(), tensor.name))
    kept = [n for n in graph.node if n.op_type != "Transpose"]
    for node in kept:
        node.input[:] = [name.removesuffix(".T") for name in node.input]
    del graph.node[:]
    graph.node.extend(kept)
    return model


@pytest.mark.parametrize("layout", ["torch", "folded"])
@pytest.mark.parametrize("kind", ["float16", "int8", "int4", "int4-asymmetric"])
def test_a_frozen_4_bit_weight_over_chunk_is_read_in_pieces_along_its_shorter_axis(kind, layout, tmp_path, monkeypatch):
    """A frozen base weight stored in 4 bits (read through DequantizeLinear) whose floats are over
    CHUNK (a language model's head) is read in pieces along its shorter axis, each piece stored and
    read by itself: the forward's product (contracting that axis) sums the pieces' products
    through Gemm's C, the backward's takes them side by side, and W itself is no longer read by
    the train model. The steps are those of the whole read, up to the order of
    the sums."""
    path = str(tmp_path / "linear.onnx")
    model = linear_model([2, 3]) if layout == "torch" else folded_linear_model([2, 3])
    onnx.save_model(model, path, save_as_external_data=True, location="weights.bin", size_threshold=1024)
    base, _, form = kind.partition("-")
    options = {"loss": "mse", "optimizer": "adamw", "optimizer_options": {"lr": 0.01},
               "lora": LoraConfig(rank=2, quantize_base=base, quantize_symmetric=form != "asymmetric")}
    whole = generate_artifacts(path, **options)
    with monkeypatch.context() as patch:
        patch.setattr(frozen_reads, "CHUNK", 100 * 256)  # W1 is 384 x 256 (or 256 x 384): 4 pieces of 64
        pieced = generate_artifacts(path, **options)
    read = "Cast" if base == "float16" else "DequantizeLinear"
    axis = "columns" if layout == "torch" else "rows"
    nodes = pieced.train_model.graph.node
    pieces = [n for n in nodes if n.op_type == read and n.input[0].startswith(f"W1.{axis}")]
    reads_of_w1 = [n for n in nodes if n.op_type == read and n.input[0] == "W1"]
    if base == "int4":
        assert len(pieces) == 8 and len({n.input[0] for n in pieces}) == 4  # each piece read forward and backward
        assert all(len(list(_users(pieced.train_model, n.output[0]))) == 1 for n in pieces)
        assert not reads_of_w1 and "W1" not in {t.name for t in pieced.train_model.graph.initializer}
        gemms = [n for n in nodes if n.op_type == "Gemm" and any(n.input[1] == p.output[0] for p in pieces)]
        assert [len(n.input) for n in gemms] == [2, 3, 3, 3]  # the sum so far is the next one's C
    else:  # float16 and int8: a stored copy would cost half or a quarter of the floats it spares
        assert not pieces
        assert len(reads_of_w1) == len([n for n in whole.train_model.graph.node if n.op_type == read and n.input[0] == "W1"])
    eval_reads = [n.input[0] for n in pieced.eval_model.graph.node if n.op_type == read and n.input[0].startswith("W1")]
    assert len(eval_reads) == (4 if base == "int4" else 1) and ("W1" in eval_reads) == (base != "int4")  # the forward's
    onnx.checker.check_model(pieced.train_model, full_check=True)
    # onnxruntime's extended optimisations compute some int8 products of its own way, differently
    # where the graphs differ: the same arithmetic is compared at the basic level
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    trainer, reference = Trainer(pieced, session_options=basic), Trainer(whole, session_options=basic)
    batch = linear_batch([2, 3])
    losses = [(trainer.step(batch), reference.step(batch)) for _ in range(4)]
    np.testing.assert_allclose(*zip(*losses), rtol=1e-6)
    assert losses[-1][0] < losses[0][0]
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trainer.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    pieced.save(tmp_path / "saved")
    assert Trainer(tmp_path / "saved").step(batch) == Trainer(pieced).step(batch)


def _users(model: onnx.ModelProto, name: str):
    return (node for node in model.graph.node if name in node.input)


def test_fill_reads_a_tensor_whole_only_when_its_first_elements_agree():
    from onnx_autodiff.passes.rewrite_rules.analysis import fill

    def constant(array):
        return ir.Value(name="c", const_value=ir.Tensor(array))

    assert fill(constant(np.full(1000, 2.0, np.float32))) == 2.0
    assert fill(constant(np.arange(1000, dtype=np.float32))) is None
    late = np.ones(1000, np.float32)
    late[-1] = 0
    assert fill(constant(late)) is None


def test_recovery_lets_go_of_the_weights_it_samples(tmp_path):
    """A weight stored beside the model is unmapped once its sample is taken (the pages read around
    the samples would otherwise stay resident, the whole of a small weight)."""
    from onnx_autodiff.weights.recovery import _sampled

    array = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    array.tofile(tmp_path / "w.bin")
    tensor = ir.ExternalTensor("w.bin", 0, array.nbytes, ir.DataType.FLOAT, shape=ir.Shape(array.shape), name="w",
                               base_dir=str(tmp_path))
    value = ir.Value(name="w", const_value=tensor)
    for transposed in (False, True):
        assert _sampled(value, transposed) is not None
        assert tensor.raw is None
    held = tensor.numpy()  # mapped by someone else: left mapped
    assert _sampled(value, False) is not None and tensor.raw is not None
    np.testing.assert_array_equal(held, array)
