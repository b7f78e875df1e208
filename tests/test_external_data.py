"""Models whose tensors are stored beside them (external data): every command reads them lazily
and writes its outputs with external data, with the numbers of the same model stored inline."""

import json
import os
import shutil
import stat

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import AutodiffPass, cleanup_passes, modelfile
from onnx_autodiff.cli import load_model, main
from onnx_autodiff.training import Trainer, TrainingArtifacts, TrainingError, generate_artifacts
from onnx_autodiff.training.artifacts import FROZEN_IN_PLACE
from onnx_autodiff.training.values import load_npz, owned_copy

SIZES = (6, 32, 32, 3)  # the 32x32 weight (4 KB) is over the 1 KB external-data threshold


def mlp() -> onnx.ModelProto:
    """MatMul-Add-Tanh layers and a scalar loss; a Reshape whose shape is an initializer too."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "X"
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        inits += [numpy_helper.from_array((rng.standard_normal((a, b)) / a**0.5).astype(np.float32), f"W{i}"),
                  numpy_helper.from_array((rng.standard_normal(b) * 0.1).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i}"])]
        x = f"h{i}"
        if i < len(SIZES) - 2:
            nodes.append(helper.make_node("Tanh", [x], [f"a{i}"]))
            x = f"a{i}"
    inits.append(numpy_helper.from_array(np.array([-1, SIZES[-1]], np.int64), "shape"))
    nodes += [helper.make_node("Reshape", [x, "shape"], ["r"]), helper.make_node("Mul", ["r", "r"], ["sq"]),
              helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", SIZES[0]])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def models(tmp_path, monkeypatch):
    """(inline path, external-data path); the working directory is elsewhere, so that nothing
    resolves the data file from it."""
    folder = tmp_path / "models"
    folder.mkdir()
    inline, external = str(folder / "inline.onnx"), str(folder / "external.onnx")
    onnx.save(mlp(), inline)
    onnx.save_model(mlp(), external, save_as_external_data=True, size_threshold=0, location="weights.bin")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return inline, external


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def feeds_for(path: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return {i.name: rng.standard_normal([d if isinstance(d, int) else 4 for d in i.shape]).astype(np.float32)
            for i in session.get_inputs()}


def run(path: str, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_valid_file(path: str, umask: int) -> None:
    """Checked with its data, strictly shaped, and every file of it with an ordinary mode."""
    onnx.checker.check_model(path, full_check=True)
    onnx.shape_inference.infer_shapes(onnx.load(path), check_type=True, strict_mode=True)
    for file in (path, path + ".data"):
        if os.path.exists(file):
            assert stat.S_IMODE(os.stat(file).st_mode) == 0o666 & ~umask, file


@pytest.mark.parametrize("command", ["grad", "jvp", "hvp", "jacobian"])
def test_commands_keep_external_data_with_the_inline_numbers(command, models, tmp_path, umask, capsys):
    inline, external = models
    out, reference = str(tmp_path / f"{command}.onnx"), str(tmp_path / f"{command}-inline.onnx")
    assert main([command, external, "-o", out]) == 0
    assert f"(tensors in {command}.onnx.data)" in capsys.readouterr().out
    assert main([command, inline, "-o", reference]) == 0
    assert os.path.getsize(out + ".data") >= 32 * 32 * 4  # the weights beside it ...
    assert modelfile.uses_external_data(onnx.load(out, load_external_data=False))
    assert not os.path.exists(reference + ".data")  # ... and not for the inline model
    assert_valid_file(out, umask)
    feeds = feeds_for(reference)
    for got, want in zip(run(out, feeds), run(reference, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_external_data_on_request_and_above_the_protobuf_limit(models, tmp_path, umask, monkeypatch, capsys):
    inline, _ = models
    requested, reference = str(tmp_path / "requested.onnx"), str(tmp_path / "reference.onnx")
    assert main(["grad", inline, "-o", requested, "--external-data"]) == 0
    assert main(["grad", inline, "-o", reference]) == 0
    assert os.path.isfile(requested + ".data") and not os.path.exists(reference + ".data")
    assert_valid_file(requested, umask)
    feeds = feeds_for(reference)
    for got, want in zip(run(requested, feeds), run(reference, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
    # a model over protobuf's limit gets it without asking (the limit lowered to this model's size)
    monkeypatch.setattr(modelfile, "PROTO_LIMIT", 1024)
    monkeypatch.setattr(modelfile, "_GRAPH_ROOM", 0)
    large = str(tmp_path / "large.onnx")
    assert main(["jvp", inline, "-o", large]) == 0
    assert "(tensors in large.onnx.data)" in capsys.readouterr().out
    assert os.path.isfile(large + ".data")


def test_weights_are_not_read_into_memory(models):
    """The model is read lazily: after the pass and the cleanup every weight is still a reference
    to its file, none mapped (the default parameters' check lets go of what it read)."""
    _, external = models
    model = load_model(external)
    ir.passes.PassManager([AutodiffPass(of="loss"), *cleanup_passes()])(model)
    weights = [v.const_value for v in model.graph.initializers.values() if v.name.startswith("W")]
    assert len(weights) == 3
    assert all(isinstance(w, ir.ExternalTensor) and w.raw is None for w in weights)


def test_check_command_reads_external_data(models, monkeypatch, capsys):
    _, external = models
    assert main(["check", external]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")
    monkeypatch.setattr(modelfile, "PROTO_LIMIT", 1024)  # over it: one clear line, not protobuf's error
    monkeypatch.setattr(modelfile, "_GRAPH_ROOM", 0)
    assert main(["check", external]) == 1
    assert "at most 2 GB, and its tensors take 0.00 GB" in capsys.readouterr().err


def test_artifacts_trainer_and_export_with_external_data(models, tmp_path, umask, capsys):
    inline, external = models
    directory, reference = tmp_path / "artifacts", tmp_path / "reference"
    common = ["--loss", "none", "--optimizer", "adamw", "--lr", "0.01"]
    assert main(["artifacts", external, "-o", str(directory), *common]) == 0
    assert main(["artifacts", inline, "-o", str(reference), *common]) == 0
    # the models read the tensors from the input's data file, where it is: no copy beside them
    folder = os.path.dirname(external)
    assert not [f for f in os.listdir(directory) if f.endswith(".data")]
    with open(directory / "artifacts.json") as stream:
        record = json.load(stream)["external_data"]
    assert record["files"] == {"weights.bin": os.path.getsize(os.path.join(folder, "weights.bin"))}
    assert os.path.samefile(directory / record["folder"], folder) and os.path.samefile(record["path"], folder)
    assert not os.path.exists(reference / "inference_model.onnx.data")
    loaded = TrainingArtifacts.load(directory)
    assert os.path.samefile(loaded.base_dir, folder) and loaded.directory == str(directory)
    assert modelfile.external_files(loaded.inference_model) == ["weights.bin"]
    modelfile.check_model(loaded.inference_model, loaded.base_dir)  # each data file there
    # self-contained on request: each model with its tensors in a data file beside it
    copied = tmp_path / "copied"
    assert main(["artifacts", external, "-o", str(copied), *common, "--external-data"]) == 0
    assert os.path.getsize(copied / "inference_model.onnx.data") >= 32 * 32 * 4
    assert_valid_file(str(copied / "inference_model.onnx"), umask)
    with open(copied / "artifacts.json") as stream:
        assert "external_data" not in json.load(stream)
    assert TrainingArtifacts.load(copied).base_dir == str(copied)
    assert main(["artifacts", inline, "-o", str(tmp_path / "requested"), *common, "--external-data"]) == 0
    assert os.path.isfile(tmp_path / "requested" / "inference_model.onnx.data")
    batch = {"X": np.random.default_rng(2).standard_normal((4, SIZES[0])).astype(np.float32)}
    assert Trainer(str(copied)).step(batch) == Trainer(str(directory)).step(batch)
    trainers = Trainer(str(directory)), Trainer(str(reference))
    batch = {"X": np.random.default_rng(2).standard_normal((4, SIZES[0])).astype(np.float32)}
    losses = []
    for _ in range(3):
        got, want = (t.step(batch) for t in trainers)
        assert got == pytest.approx(want, rel=1e-6)
        losses.append(got)
    assert losses[-1] < losses[0]
    exported, expected = str(tmp_path / "trained.onnx"), str(tmp_path / "trained-inline.onnx")
    proto = trainers[0].export(exported)
    trainers[1].export(expected)
    assert os.path.isfile(exported + ".data") and not os.path.exists(expected + ".data")
    assert modelfile.uses_external_data(proto)  # it names the data file instead of holding the tensors
    assert_valid_file(exported, umask)
    np.testing.assert_allclose(run(exported, batch)[0], run(expected, batch)[0], rtol=1e-6)
    # in memory, every tensor inline
    session = ort.InferenceSession(trainers[0].export().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, batch)[0], run(expected, batch)[0], rtol=1e-6)
    # on request, for artifacts read without external data
    requested = str(tmp_path / "requested.onnx")
    trainers[1].export(requested, external_data=True)
    assert os.path.isfile(requested + ".data")
    np.testing.assert_array_equal(run(requested, batch)[0], run(expected, batch)[0])


def test_a_large_constant_of_the_backward_keeps_the_artifacts_reading_the_input(tmp_path):
    """A constant the build makes, however large (the ones that sum a bias's gradient over 65,536
    rows: 256 KiB), stays in the model file: the artifacts still read the weights where they are,
    with no copy of them beside the models."""
    rows = 1 << 16
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"]),
         helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)], "bias",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(rng.standard_normal((4, 256)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(256, np.float32), "b")])
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path,
                    save_as_external_data=True, size_threshold=0, location="weights.bin")
    artifacts = generate_artifacts(str(path), loss=None, optimizer="sgd")
    made = [t for t in artifacts.train_model.graph.initializer
            if t.data_location != TensorProto.EXTERNAL and len(t.raw_data) >= FROZEN_IN_PLACE]
    assert made, "the build made no constant this large: the test no longer tests what it says"
    directory = tmp_path / "artifacts"
    artifacts.save(directory)
    assert not [f for f in os.listdir(directory) if f.endswith(".data")]
    with open(directory / "artifacts.json") as stream:
        assert set(json.load(stream)["external_data"]["files"]) == {"weights.bin"}
    batch = {"X": rng.standard_normal((rows, 4)).astype(np.float32)}
    assert Trainer(str(directory)).step(batch) == Trainer(artifacts).step(batch)


def test_artifacts_find_the_data_file_they_read_or_say_where_it_was(models, tmp_path):
    """Saved artifacts name the folder of the data file they read relative to themselves and as it
    was: moved alone they still find it; a file gone or changed in size is one clear error; saved
    again elsewhere they read it from where it is, or copy it with external_data=True."""
    _, external = models
    directory = tmp_path / "artifacts"
    assert main(["artifacts", external, "-o", str(directory), "--loss", "none", "--optimizer", "sgd"]) == 0
    batch = {"X": np.random.default_rng(2).standard_normal((4, SIZES[0])).astype(np.float32)}
    want = Trainer(str(directory)).step(batch)
    moved = tmp_path / "elsewhere" / "moved"
    shutil.move(str(directory), str(moved))
    assert Trainer(str(moved)).step(batch) == want  # by the absolute path
    again = tmp_path / "again"
    TrainingArtifacts.load(moved).save(again)
    assert not [f for f in os.listdir(again) if f.endswith(".data")]
    assert Trainer(str(again)).step(batch) == want
    data = os.path.join(os.path.dirname(external), "weights.bin")
    os.rename(data, data + ".away")
    with pytest.raises(TrainingError, match=r"reads? their tensors from weights\.bin in .*, but weights\.bin is not there: put it back"):
        TrainingArtifacts.load(again)
    with open(data, "wb") as stream:  # another file in its place
        stream.write(b"\0" * 16)
    with pytest.raises(TrainingError, match="weights.bin changed size since then"):
        Trainer(str(again))
    os.replace(data + ".away", data)
    copy = tmp_path / "copy"
    TrainingArtifacts.load(again).save(copy, external_data=True)  # self-contained
    os.rename(data, data + ".away")
    assert Trainer(str(copy)).step(batch) == want
    os.replace(data + ".away", data)


def test_nothing_half_written_when_the_check_fails(models, tmp_path):
    """The data file and the model are written under temporary names and checked before either
    replaces what was there: a failed check leaves the old pair and no temporary file."""
    _, external = models
    out = str(tmp_path / "out.onnx")
    assert main(["grad", external, "-o", out]) == 0
    before = {name: (tmp_path / name).read_bytes() for name in ("out.onnx", "out.onnx.data")}

    def refuse(model):
        assert isinstance(model, str) and os.path.isfile(model + ".data")  # checked with its data
        raise onnx.checker.ValidationError("refused")

    with pytest.raises(onnx.checker.ValidationError):
        modelfile.save_model(load_model(external), out, check=refuse)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(tmp_path)) == sorted(["models", "elsewhere", *before])


def test_checkpoints_are_memory_mapped_and_copied_once(tmp_path):
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "f": np.asfortranarray(np.ones((2, 3))),
              "__step__": np.array(7, np.int64)}
    np.savez(tmp_path / "c.npz", **arrays)
    loaded = load_npz(tmp_path / "c.npz", map_from=0)
    assert isinstance(loaded["w"], np.memmap) and isinstance(loaded["f"], np.memmap)
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array)
    copy = owned_copy(loaded["w"], np.float32)
    assert not isinstance(copy, np.memmap) and copy.flags.writeable and copy.flags.c_contiguous
    np.testing.assert_array_equal(copy, arrays["w"])


def test_large_model_benchmark_runs_small(tmp_path, capsys):
    """benchmarks/large_model.py at 1/64 of its widths: grad, the onnxruntime check, artifacts, Trainer."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "large_model.py"
    spec = importlib.util.spec_from_file_location("large_model", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--scale", "64", "--train", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for line in ("onnx-autodiff grad: exit 0", "check: exit 0", "onnx-autodiff artifacts: exit 0", "Trainer: 2 steps"):
        assert line in out, out
    assert os.listdir(tmp_path) == []  # the files are removed


def test_the_check_of_a_proto_leaves_it_as_it_is_and_checks_large_held_tensors_by_type(models, monkeypatch):
    """check_model on a proto in memory: its small external tensors are read into a stand-in, not
    into the caller's proto; a tensor the proto holds of HELD_LARGE bytes or more is checked as an
    input of its type and shape (never copied), and a broken model still fails."""
    inline, external = models
    for path in (inline, external):
        proto = onnx.load(path, load_external_data=False)
        before = proto.SerializeToString()
        monkeypatch.setattr(modelfile, "HELD_LARGE", 16)
        modelfile.check_model(proto, base_dir=os.path.dirname(path), full=True)
        assert proto.SerializeToString() == before
        proto.graph.node[0].input[0] = "nowhere"
        with pytest.raises(onnx.checker.ValidationError):
            modelfile.check_model(proto, base_dir=os.path.dirname(path), full=True)


def test_a_small_external_weight_held_by_a_view_is_written(tmp_path, capsys):
    """An external weight under the threshold goes into the written model file; a pass may hold an
    array viewing its mapping (the LSTM's backward of an input reads its fixed weights), so it is
    copied rather than unmapped (onnx-ir's unmapping raised BufferError)."""
    rng = np.random.default_rng(2)
    hidden, features = 4, 3
    weights = {"W": rng.standard_normal((1, 4 * hidden, features)), "R": rng.standard_normal((1, 4 * hidden, hidden))}
    nodes = [helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=hidden),
             helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "lstm", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", features])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array((v * 0.5).astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    source = tmp_path / "lstm.onnx"
    onnx.save(model, source, save_as_external_data=True, location="lstm.onnx.data", size_threshold=0)
    assert main(["grad", str(source), "-o", str(tmp_path / "grads.onnx"), "--wrt", "X"]) == 0, capsys.readouterr().err
    session = ort.InferenceSession(str(tmp_path / "grads.onnx"), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((5, 2, features)).astype(np.float32)
    grads = session.run(["grad_X"], {"X": x})[0]
    inline = ir.from_proto(onnx.load(source))  # its tensors read into the proto
    AutodiffPass(of="loss", wrt=["X"])(inline)
    expected = ort.InferenceSession(ir.to_proto(inline).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(["grad_X"], {"X": x})[0]
    np.testing.assert_array_equal(grads, expected)
