"""QLoRA: frozen base weights quantized at build time, read back and quantized again after merging."""

import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training.lora import LoraConfig, LoraPass
from onnx_autodiff import modelfile
from onnx_autodiff.weights import quantized as quantize
from onnx_autodiff.weights.quantized import nbits_read_as_dequantizelinear
from onnx_autodiff.weights.quantized import dequantized, quantized, requantized, stored_weight
from tests.rules.test_quantized import FORMS, shipped_base

K, N, M = 40, 24, 12  # K not a multiple of the blocks: the last block is short


def _session(proto):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits,block,symmetric", [(4, 16, True), (4, 16, False), (4, 32, True), (8, K, True), (8, K, False)])
def test_each_weight_is_within_half_a_step(bits, block, symmetric):
    w = np.random.default_rng(bits + block).standard_normal((K, N))
    q, scale, zero = quantized(w, bits, block, symmetric)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    assert q.min() >= low and q.max() <= high
    rows = np.arange(K) // block
    assert np.all(np.abs(dequantized(q, scale, zero, block) - w) <= scale[rows] / 2 + 1e-12)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantized_a_few_columns_at_a_time_as_all_at_once(monkeypatch, symmetric):
    """Large weights are quantized in slices of columns (bounded float64 copies): the same result,
    in the smallest integer type, from a float32 weight as from its float64 copy."""
    w = np.random.default_rng(7).standard_normal((K, N)).astype(np.float32)
    whole = quantized(w.astype(np.float64), 4, 16, symmetric)
    monkeypatch.setattr(quantize, "COLUMNS_AT_ONCE", 3 * K)  # 8 slices of 3 columns
    sliced = quantized(w, 4, 16, symmetric)
    assert sliced[0].dtype == (np.int8 if symmetric else np.uint8)
    for a, b in zip(whole, sliced):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("form", [f for f in FORMS if f != "float16"])
def test_stored_weights_read_back_and_quantized_again(form):
    """stored_weight reads each shipped form as its own test builder dequantizes it; a weight
    quantized again in the same scheme reads back within half a step of the new scale."""
    rng = np.random.default_rng(FORMS.index(form))
    proto, weight = shipped_base(form, rng)
    model = ir.from_proto(proto)
    base = "MatMulNBits" if form.startswith("nbits") else "DequantizeLinear"
    stored = "B" if base == "MatMulNBits" else "Wq"
    np.testing.assert_allclose(stored_weight(model, stored, base), weight, rtol=1e-6, atol=1e-7)
    changed = weight + 0.02 * rng.standard_normal(weight.shape)
    parts = requantized(model, stored, base, changed)
    for name, array in parts.items():
        value = model.graph.initializers[name]
        assert array.shape == tuple(value.const_value.shape) and ir.DataType.from_numpy(array.dtype) == value.dtype, name
        value.const_value = ir.Tensor(array, name=name)
    again = stored_weight(model, stored, base)
    step = {"nbits4": 0.1, "nbits4zp": 0.1, "nbits8": 0.01, "int8_axis": 0.01, "int4_blocked": 0.1}[form]
    assert np.abs(again - changed).max() < step * np.abs(changed).max()


def two_products():
    """y = (x @ W1) @ W2ᵀ, W2 [M, N] stored as torch's nn.Linear weight (read through a Transpose)."""
    rng = np.random.default_rng(7)
    w1 = (rng.standard_normal((K, N)) / 6).astype(np.float32)
    w2 = (rng.standard_normal((M, N)) / 5).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Transpose", ["W2"], ["W2T"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "W2T"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [3, K])],
                              [helper.make_tensor_value_info("y", 1, [3, M])],
                              [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), w1.astype(np.float64), w2.astype(np.float64)


CONFIGS = [("int8", "dequantizelinear", True), ("int8", "dequantizelinear", False), ("int4", "dequantizelinear", True),
           ("int4", "dequantizelinear", False), ("float16", "dequantizelinear", True), ("int4", "matmulnbits", True),
           ("int4", "matmulnbits", False), ("int8", "matmulnbits", True)]


@pytest.mark.parametrize("kind,fmt,symmetric", CONFIGS)
def test_qlora_from_a_float_model(kind, fmt, symmetric):
    from onnx_autodiff.training import Trainer, generate_artifacts

    proto, w1, w2 = two_products()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, K)).astype(np.float32)
    labels = rng.standard_normal((3, M)).astype(np.float32)
    config = LoraConfig(rank=4, quantize_base=kind, quantize_format=fmt, quantize_symmetric=symmetric, quantize_block=16)
    artifacts = generate_artifacts(proto, loss="mse", optimizer="adamw", optimizer_options={"lr": 1e-2}, lora=config)
    want_base = {"float16": "Cast", "dequantizelinear": "DequantizeLinear", "matmulnbits": "MatMulNBits"}
    assert [a["base"] for a in artifacts.layout["lora"]["adapters"]] == [want_base["float16" if kind == "float16" else fmt]] * 2
    assert artifacts.params == ["W1.lora_A", "W1.lora_B", "W2.lora_A", "W2.lora_B"]
    stored = {t.name: t for t in artifacts.inference_model.graph.initializer}
    assert {"W1", "W2"} <= set(stored) and stored["W1"].data_type != onnx.TensorProto.FLOAT
    if kind != "float16":
        assert {"W1", "W2"} <= set(artifacts.left_out)
    for model in (artifacts.train_model, artifacts.inference_model):
        onnx.checker.check_model(model, full_check=True)
    # the quantized base is the float model up to its rounding: about 1/2^bits of the weights' range
    base = _session(artifacts.inference_model).run(None, {"x": x})[0]
    exact = x.astype(np.float64) @ w1 @ w2.T
    relative = {"int4": 0.25, "int8": 0.02, "float16": 2e-3}[kind]
    assert np.abs(base - exact).max() < relative * np.abs(exact).max()
    trainer = Trainer(artifacts)
    losses = [trainer.step({"x": x, "labels": labels}) for _ in range(10)]
    assert losses[-1] < 0.8 * losses[0]
    kept = _session(trainer.export(merge=False)).run(None, {"x": x})[0]
    merged_proto = trainer.export()
    onnx.checker.check_model(merged_proto, full_check=True)
    assert [t.data_type for t in merged_proto.graph.initializer] == [t.data_type for t in artifacts.inference_model.graph.initializer]
    merged = _session(merged_proto).run(None, {"x": x})[0]
    # quantizing the merged weights again costs about what quantizing the base did
    assert np.abs(merged - kept).max() < relative * np.abs(kept).max()


@pytest.mark.parametrize("kind,fmt,export_kind", [("int4", "dequantizelinear", "plain"), ("int4", "matmulnbits", "optimize"),
                                                  ("int8", "dequantizelinear", "optimize"), ("float16", "dequantizelinear", "plain")])
def test_qlora_on_an_exported_llama_is_peft_on_the_dequantized_module(kind, fmt, export_kind):
    """QLoRA on q_proj/v_proj of a Llama export, every projection stored quantized: three AdamW
    steps agree with peft on the module whose weights are the stored ones dequantized."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from test_as_exported import _run_torch, exported, feeds_for
    from test_exported_transformers import batch

    from onnx_autodiff.training import Trainer, generate_artifacts

    module, proto = exported("llama", export_kind)
    options = {"lr": 1e-2}
    config = LoraConfig(rank=4, alpha=8, targets=["*q_proj*", "*v_proj*"], quantize_base=kind, quantize_format=fmt)
    artifacts = generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options=options, lora=config)
    model = ir.from_proto(artifacts.inference_model)
    bases = {}
    for node in model.graph:
        if node.op_type in ("DequantizeLinear", "MatMulNBits", "Cast") and node.inputs[1 if node.op_type == "MatMulNBits" else 0].is_initializer():
            stored = node.inputs[1 if node.op_type == "MatMulNBits" else 0]
            bases[stored.name] = {"Cast": "Cast", "DequantizeLinear": "DequantizeLinear"}.get(node.op_type, "MatMulNBits")
    modules = {e["initializer"]: e for e in artifacts.layout["modules"]}
    projections = [n for n, _ in module.named_parameters() if n.endswith("proj.weight")]
    quantized_modules = {modules[s]["name"] for s in bases}
    assert set(projections) <= quantized_modules, "every projection's weight is stored quantized"
    state = module.state_dict()
    for stored, base in bases.items():
        entry = modules[stored]
        w = stored_weight(model, stored, base)
        w = w.T if base == "MatMulNBits" or entry["transposed"] else w  # to the module's [out, in]
        assert tuple(w.shape) == tuple(state[entry["name"]].shape), entry["name"]
        state[entry["name"]] = torch.from_numpy(w.astype(np.float32))
    module.load_state_dict(state)
    peft_model = peft.get_peft_model(module, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                             lora_dropout=0.0))
    theirs = {name.removeprefix("base_model.model."): layer for name, layer in peft_model.named_modules()
              if isinstance(layer, peft.tuners.lora.LoraLayer)}
    ours = {modules[a["weight"]]["name"].removesuffix(".weight"): a for a in artifacts.layout["lora"]["adapters"]}
    assert set(ours) == set(theirs) and len(ours) == 4
    for name, adapter in ours.items():
        theirs[name].lora_A["default"].weight.data = torch.from_numpy(artifacts.checkpoint[adapter["A"]].T.copy())
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], **options)
    trainer = Trainer(artifacts)
    # onnxruntime's MatMulNBits kernel accumulates in its own order: a little looser
    tolerance = 2e-4 if fmt == "matmulnbits" else 2e-5
    for step in range(3):
        loss = trainer.step(feeds_for(proto, step))
        np.testing.assert_allclose(loss, _run_torch(peft_model, batch(step), optimizer), rtol=tolerance)


def test_the_command_line_quantizes_the_base_and_notes_the_frozen_weights(tmp_path, capsys):
    from onnx_autodiff.cli import main
    from onnx_autodiff.training import TrainingArtifacts

    proto, _, _ = two_products()
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    out = tmp_path / "artifacts"
    assert main(["artifacts", str(path), "-o", str(out), "--loss", "mse", "--lora", "2", "--quantize-base", "int4",
                 "--quantize-format", "matmulnbits", "--quantize-block", "16", "--quantize-asymmetric"]) == 0
    artifacts = TrainingArtifacts.load(out)
    kernels = [n for n in artifacts.inference_model.graph.node if n.op_type == "MatMulNBits"]
    assert len(kernels) == 2 and all(len(n.input) == 4 for n in kernels)  # with zero points
    assert {a.i for n in kernels for a in n.attribute if a.name == "block_size"} == {16}
    assert "2 quantized weights stay frozen (W1, W2)" in capsys.readouterr().err
    assert main(["params", str(path)]) == 0 and "quantized" not in capsys.readouterr().out
    quantized_model = tmp_path / "q.onnx"
    onnx.save(artifacts.inference_model, quantized_model)
    assert main(["params", str(quantized_model)]) == 0
    assert "W1 " in capsys.readouterr().out.split("quantized weight (4-bit MatMulNBits)")[0]
    assert main(["artifacts", str(path), "-o", str(tmp_path / "x"), "--lora", "2", "--quantize-block", "16"]) == 2
    assert "--quantize-block and --quantize-asymmetric need --quantize-base" in capsys.readouterr().err
    assert main(["artifacts", str(path), "-o", str(tmp_path / "x"), "--lora", "2", "--quantize-format", "dequantizelinear"]) == 1
    error = capsys.readouterr().err
    assert "reads a model's MatMulNBits weights through DequantizeLinear; this model has none" in error
    assert len(error.strip().splitlines()) == 1
    assert main(["artifacts", str(path), "-o", str(tmp_path / "y"), "--quantize-base", "int8"]) == 2
    assert "needs --lora RANK" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["int4", "float16"])
def test_merge_cost_is_the_loss_of_the_merged_export(kind):
    """merge_cost's merged loss is the loss of export()'s model, computed here from its output."""
    from onnx_autodiff.training import Trainer, generate_artifacts

    proto, _, _ = two_products()
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((3, K)).astype(np.float32), "labels": rng.standard_normal((3, M)).astype(np.float32)}
    artifacts = generate_artifacts(proto, loss="mse", optimizer="adamw", optimizer_options={"lr": 3e-2},
                                   lora=LoraConfig(rank=4, quantize_base=kind))
    trainer = Trainer(artifacts)
    for _ in range(10):
        trainer.step(batch)
    cost = trainer.merge_cost(batch)
    merged = _session(trainer.export()).run(None, {"x": batch["x"]})[0]
    kept = _session(trainer.export(merge=False)).run(None, {"x": batch["x"]})[0]
    mse = lambda y: float(np.mean((y.astype(np.float64) - batch["labels"]) ** 2))  # noqa: E731
    np.testing.assert_allclose(cost["merged"], mse(merged), rtol=1e-5)
    np.testing.assert_allclose(cost["adapted"], mse(kept), rtol=1e-5)
    assert cost["merged"] != cost["adapted"]  # rounding the merged weights costs something


def test_merge_cost_reads_the_merged_scales_where_the_trainer_shares_the_stored_ones(tmp_path, monkeypatch):
    """A trainer maps large stored float tensors (a quantized base's scales) once for all its
    sessions; merge_cost's session reads the merged weights' own scales, not those."""
    from onnx_autodiff.training import Trainer, TrainingArtifacts, generate_artifacts
    from onnx_autodiff.training import sessions as sessions_module

    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((128, 256)) / 16).astype(np.float32)  # scales [128, 8]: 4 KB, stored in a file
    proto = helper.make_model(helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 256])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 128])], [numpy_helper.from_array(weight, "W")]),
        opset_imports=[helper.make_opsetid("", 21)])
    batch = {"x": rng.standard_normal((3, 256)).astype(np.float32), "labels": rng.standard_normal((3, 128)).astype(np.float32)}
    artifacts = generate_artifacts(proto, loss="mse", optimizer="adamw", optimizer_options={"lr": 3e-2},
                                   lora=LoraConfig(rank=4, quantize_base="int4"))
    artifacts.save(tmp_path / "artifacts", external_data=True)
    monkeypatch.setattr(sessions_module, "FROZEN_IN_PLACE", 16)  # (the scales here are small)
    trainer = Trainer(TrainingArtifacts.load(tmp_path / "artifacts"))
    assert any(name.endswith(".scale") for name in trainer.sessions.frozen)
    for _ in range(10):
        trainer.step(batch)
    cost = trainer.merge_cost(batch)
    merged = _session(trainer.export()).run(None, {"x": batch["x"]})[0]
    np.testing.assert_allclose(cost["merged"], float(np.mean((merged.astype(np.float64) - batch["labels"]) ** 2)), rtol=1e-5)


@pytest.mark.parametrize("kind,fmt", [("int4", "matmulnbits"), ("int8", "dequantizelinear")])
def test_module_state_dict_of_a_quantized_base_loads_into_the_module(kind, fmt):
    """module_state_dict gives a quantized base's parameters dequantized, adapters merged, in the
    module's layout: the module then computes the trainer's loss."""
    torch = pytest.importorskip("torch")
    from test_as_exported import exported, feeds_for
    from test_exported_transformers import batch

    from onnx_autodiff.training import Trainer, generate_artifacts

    module, proto = exported("llama", "optimize")
    config = LoraConfig(rank=4, targets=["*q_proj*"], quantize_base=kind, quantize_format=fmt)
    artifacts = generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options={"lr": 1e-2}, lora=config)
    trainer = Trainer(artifacts)
    for step in range(2):
        trainer.step(feeds_for(proto, step))
    state = trainer.module_state_dict()
    assert all(v.dtype == np.float32 for v in state.values())
    module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    feeds = batch(5)
    want = float(trainer.evaluate(feeds_for(proto, 5))["loss"])
    with torch.no_grad():
        loss = module(torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"])).item()
    # the module computes in float32 what MatMulNBits' kernel computes in its own order
    np.testing.assert_allclose(loss, want, rtol=2e-4)


@pytest.mark.parametrize("kind,fmt", [("int4", "matmulnbits"), ("int8", "dequantizelinear"), ("float16", "dequantizelinear")])
def test_saved_artifacts_hold_a_base_quantized_anew_once(tmp_path, kind, fmt):
    """A base quantized at build time is written into the train model's data file only; the eval
    and inference models read it there. Saved twice, the files are the same bytes; the trainer
    steps from the directory and its merged export runs."""
    from onnx_autodiff.training import Trainer, TrainingArtifacts, generate_artifacts

    rng = np.random.default_rng(5)
    width = 1024  # a 4 MB float weight: its stored form is over the size kept inside model files
    w = (rng.standard_normal((width, width)) / width**0.5).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [2, width])],
                              [helper.make_tensor_value_info("y", 1, [2, width])], [numpy_helper.from_array(w, "W")])
    source = tmp_path / "model" / "m.onnx"
    source.parent.mkdir()
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), source,
                    save_as_external_data=True, location="m.onnx.data")
    config = LoraConfig(rank=2, quantize_base=kind, quantize_format=fmt)
    artifacts = generate_artifacts(str(source), loss="mse", optimizer="adamw", lora=config)
    first, second = tmp_path / "a", tmp_path / "b"
    artifacts.save(first)
    artifacts.save(second)
    data = sorted(f for f in os.listdir(first) if f.endswith(".data"))
    assert data == ["training_model.onnx.data"]
    for name in sorted(os.listdir(first)):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for name in ("training_model.onnx", "eval_model.onnx", "inference_model.onnx"):
        onnx.checker.check_model(str(first / name), full_check=True)
        assert "training_model.onnx.data" in modelfile.external_files(onnx.load(first / name, load_external_data=False))
    batch = {"x": rng.standard_normal((2, width)).astype(np.float32), "labels": rng.standard_normal((2, width)).astype(np.float32)}
    trainer = Trainer(TrainingArtifacts.load(first))
    losses = [trainer.step(batch) for _ in range(3)]
    assert losses[-1] < losses[0]
    kept = _session(trainer.export(merge=False)).run(None, {"x": batch["x"]})[0]
    np.testing.assert_allclose(np.mean((kept.astype(np.float64) - batch["labels"]) ** 2),
                               trainer.evaluate(batch)["loss"], rtol=1e-5)


def nbits_model(bits: int, zero_points: bool, bias: bool, K: int, rng, N: int = 24):
    """y = MatMulNBits(x, B) (+ bias), blocks of 16; and its weight W [K, N] in float64."""
    block = 16
    blocks = -(-K // block)
    top = 2**bits - 1
    q = rng.integers(0, top + 1, (N, blocks, block)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (N, blocks)).astype(np.float32)
    zero = rng.integers(0, top + 1, (N, blocks)).astype(np.uint8) if zero_points else None
    offset = zero.astype(np.float64)[..., None] if zero_points else 2.0 ** (bits - 1)
    weight = ((q - offset) * scales[..., None]).reshape(N, -1)[:, :K].T
    packed = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
    if zero_points and bits == 4:  # each row's zero points padded to whole bytes
        padded = np.concatenate([zero, np.zeros((N, blocks % 2), np.uint8)], axis=1)
        zero = padded[:, 0::2] | (padded[:, 1::2] << 4)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "scales")]
    inputs = ["x", "B", "scales", "zero_points" if zero_points else ""]
    if zero_points:
        inits.append(numpy_helper.from_array(zero.reshape(-1), "zero_points"))
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "bias"))
        inputs += ["", "bias"]
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=block,
                            name="product")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model, weight


def shipped_file(tmp_path) -> tuple[str, np.ndarray, np.ndarray]:
    """A file as shipped: y = (x @ W1) @ W2, both products quantized by onnxruntime's own
    MatMulNBitsQuantizer (int4, blocks of 16), saved with external data; and W1, W2 as its kernels
    compute them (read off their products with the identity, not by this project's code)."""
    matmul_nbits_quantizer = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    rng = np.random.default_rng(7)
    weights = {"W1": rng.standard_normal((32, 32)).astype(np.float32) * 0.2,
               "W2": rng.standard_normal((32, 96)).astype(np.float32) * 0.2}  # the head: 96 outputs of 32
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 96])],
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    quantizer = matmul_nbits_quantizer.MatMulNBitsQuantizer(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), block_size=16, is_symmetric=True)
    quantizer.process()
    proto = quantizer.model.model
    assert [n.op_type for n in proto.graph.node] == ["MatMulNBits"] * 2
    eye = np.eye(32, dtype=np.float32)
    read = []
    for node in proto.graph.node:  # each product alone, of the identity: the weight as the kernel reads it
        one = helper.make_model(helper.make_graph(
            [node], "g", [helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT, [32, 32])],
            [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
            [t for t in proto.graph.initializer if t.name in node.input]), opset_imports=proto.opset_import)
        read.append(_session(one).run(None, {node.input[0]: eye})[0].astype(np.float64))
    path = str(tmp_path / "model_q4.onnx")
    onnx.save_model(proto, path, save_as_external_data=True, location="model_q4.onnx.data", size_threshold=0)
    return path, *read


def test_a_shipped_files_head_is_read_in_pieces(tmp_path, monkeypatch):
    """LoRA on a file onnxruntime's quantizer wrote, its weights read through DequantizeLinear: a
    head large enough to be read in pieces (here made so) is read along its shorter axis, each
    piece by itself, in the forward and the backward, never whole, although the model stores it
    in a file (the pieces of its columns are copies, saved beside the train model); the steps are
    those of the same model with the weights dequantized as float initializers and the same
    adapters, and those of the kernels."""
    from onnx_autodiff.training import Trainer, generate_artifacts
    from onnx_autodiff.training.generation import frozen_reads

    path, w1, w2 = shipped_file(tmp_path)
    options = {"loss": "mse", "optimizer": "adamw", "optimizer_options": {"lr": 1e-2}}
    lora = {"rank": 4, "targets": ["W1*"]}
    kernel = generate_artifacts(path, **options, lora=LoraConfig(**lora))
    with monkeypatch.context() as patch:
        patch.setattr(frozen_reads, "CHUNK", 32 * 32)  # pieces of at most 1,024 of the head's 3,072 weights
        patch.setattr(frozen_reads, "FROZEN_IN_PLACE", 1024)  # (a weight of 32 x 96 floats is not large)
        pieced = generate_artifacts(path, **options, lora=LoraConfig(**lora, quantize_format="dequantizelinear"))
    graph = pieced.train_model.graph
    sizes = {t.name: list(t.dims) for t in graph.initializer}
    reads = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in sizes]
    head = [n for n in reads if n.input[0].startswith("W2")]
    assert "MatMulNBits" not in {n.op_type for n in graph.node}
    # the head [96, 32] stored as [N, K]: two pieces of 16 of K's columns (1,024 // 96 = 10 columns, a
    # whole block of 16), each read once by the forward and once by the backward; nothing reads it whole
    assert sorted(sizes[n.input[0]] for n in head) == [[96, 16]] * 4 and "W2_Q4" not in sizes
    pieced.save(tmp_path / "pieced")
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((2, 3, 32)).astype(np.float32),
             "labels": rng.standard_normal((2, 3, 96)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W1_Q4"], ["h"]), helper.make_node("MatMul", ["h", "W2_Q4"], ["y"])]
    floats = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 96])],
        [numpy_helper.from_array(w.astype(np.float32), name) for name, w in (("W1_Q4", w1), ("W2_Q4", w2))]),
        opset_imports=[helper.make_opsetid("", 18)])
    reference = generate_artifacts(floats, **options, lora=LoraConfig(**lora))
    assert reference.params == pieced.params == ["W1_Q4.lora_A", "W1_Q4.lora_B"]
    np.testing.assert_array_equal(reference.checkpoint["W1_Q4.lora_A"], pieced.checkpoint["W1_Q4.lora_A"])  # the same A
    trainers = [Trainer(reference), Trainer(kernel), Trainer(str(tmp_path / "pieced"))]
    losses = np.array([[t.step(batch) for t in trainers] for _ in range(4)])
    assert losses[-1, 0] < losses[0, 0]
    for column in (1, 2):
        np.testing.assert_allclose(losses[:, column], losses[:, 0], rtol=1e-5)


@pytest.mark.parametrize("bits,zero_points,bias,K", [(4, False, False, 64), (4, True, True, 48), (8, False, True, 64),
                                                     (8, True, False, 48)])
def test_matmulnbits_read_as_dequantizelinear_is_the_kernels_product(bits, zero_points, bias, K):
    """MatMulNBits in standard operators reads B's bytes as they are ([N, K] unsigned 4- or 8-bit),
    its scales and zero points (4-bit ones unpacked from their padded rows; 2^(bits-1) where none):
    the product is the kernel's and numpy's of the dequantized weight."""
    import onnxruntime as ort

    rng = np.random.default_rng(bits + K)
    proto, weight = nbits_model(bits, zero_points, bias, K, rng)
    model = ir.from_proto(proto)
    stored, kept = nbits_read_as_dequantizelinear(model.graph)
    assert kept == {} and [n.op_type for n in model.graph] == ["DequantizeLinear", "Transpose", "MatMul", *(["Add"] * bias)]
    data = model.graph.initializers["B"]
    assert data.dtype == (ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8) and list(data.shape) == [24, K]
    assert data.const_value.tobytes() == numpy_helper.to_array(proto.graph.initializer[0]).tobytes()
    assert stored[:2] == ["B", "scales"] and len(stored) == 3  # B's and the scales' names, and the zero points'
    assert stored[2] == "zero_points" if zero_points else stored[2].startswith("B.zero_point")
    converted = ir.to_proto(model)
    onnx.checker.check_model(converted, full_check=True)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    (kernel,) = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (standard,) = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    expected = x.astype(np.float64) @ weight + (numpy_helper.to_array(proto.graph.initializer[-1]) if bias else 0)
    np.testing.assert_allclose(standard, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(standard, kernel, rtol=1e-5, atol=1e-5)


def test_matmulnbits_that_standard_operators_cannot_read_as_stored_stay():
    """K not a whole number of blocks (the kernel pads each row) or act-order g_idx: the node stays,
    with the reason."""
    proto, _ = nbits_model(4, False, False, 40, np.random.default_rng(0))
    model = ir.from_proto(proto)
    stored, kept = nbits_read_as_dequantizelinear(model.graph)
    assert stored == [] and kept == {"product": "K=40 is not a whole number of blocks of 16"}
    assert [n.op_type for n in model.graph] == ["MatMulNBits"]
    # a weight also read by a node that stays: it keeps its name for that node, the read its own
    proto, _ = nbits_model(4, False, False, 64, np.random.default_rng(0))
    staying = onnx.NodeProto()
    staying.CopyFrom(proto.graph.node[0])
    staying.name, staying.output[0] = "staying", "z"
    staying.input.append("g_idx")
    proto.graph.node.append(staying)
    proto.graph.initializer.append(numpy_helper.from_array(np.repeat(np.arange(4, dtype=np.int32), 16), "g_idx"))
    model = ir.from_proto(proto)
    stored, kept = nbits_read_as_dequantizelinear(model.graph)
    assert kept == {"staying": "act-order g_idx"} and stored[0] != "B" and stored[1] != "scales"
    assert [n.op_type for n in model.graph] == ["DequantizeLinear", "Transpose", "MatMul", "MatMulNBits"]
    assert model.graph.initializers["B"].const_value.dtype == ir.DataType.UINT8
    assert model.graph.node(3).inputs[1] is model.graph.initializers["B"]


@pytest.mark.parametrize("bits,zero_points", [(4, False), (4, True), (8, False)])
def test_a_models_matmulnbits_trained_through_dequantizelinear(bits, zero_points, tmp_path):
    """LoRA on a model's own MatMulNBits base, by default (or quantize_format="dequantizelinear"):
    the train and eval models read the weights through DequantizeLinear (from the input's data
    file, as stored), the inference model keeps its MatMulNBits; the steps, the evaluation and both
    exports are those of the artifacts that keep the kernel (quantize_format="matmulnbits"). The
    kernel stays by default where the model's opset is kept (upgrade_opset=False) and on WebGPU."""
    from onnx_autodiff.training import Trainer, generate_artifacts

    rng = np.random.default_rng(bits)
    proto, _ = nbits_model(bits, zero_points, True, 64, rng)
    proto.graph.node.insert(0, helper.make_node("Relu", ["x"], ["h"]))  # the adapter reads an activation
    proto.graph.node[1].input[0] = "h"
    proto.opset_import[0].version = 18  # the build converts the train model's opset to 21
    path = str(tmp_path / "q4.onnx")
    onnx.save_model(proto, path, save_as_external_data=True, location="q4.bin", size_threshold=0)
    batch = {"x": rng.standard_normal((2, 3, 64)).astype(np.float32), "labels": rng.standard_normal((2, 3, 24)).astype(np.float32)}
    options = {"loss": "mse", "optimizer": "adamw", "optimizer_options": {"lr": 1e-2}}
    kernel = generate_artifacts(path, **options, lora=LoraConfig(rank=4, quantize_format="matmulnbits"))
    standard = generate_artifacts(path, **options, lora=LoraConfig(rank=4))
    ops = lambda m: {n.op_type for n in m.graph.node}  # noqa: E731
    explicit = generate_artifacts(path, **options, lora=LoraConfig(rank=4, quantize_format="dequantizelinear"))
    assert explicit.train_model == standard.train_model
    for kept in (generate_artifacts(path, **options, lora=LoraConfig(rank=4), upgrade_opset=False),
                 generate_artifacts(path, **options, lora=LoraConfig(rank=4), target="webgpu")):
        assert "MatMulNBits" in ops(kept.train_model) and kept.layout["lora"]["quantize_format"] == "matmulnbits"
    assert "MatMulNBits" in ops(kernel.train_model) and "MatMulNBits" not in ops(standard.train_model) | ops(standard.eval_model)
    assert "MatMulNBits" in ops(standard.inference_model) and standard.layout["lora"]["adapters"] == kernel.layout["lora"]["adapters"]
    data = next(t for t in standard.train_model.graph.initializer if t.name == "B")
    assert data.data_location == TensorProto.EXTERNAL and {e.key: e.value for e in data.external_data}["location"] == "q4.bin"
    assert "B" in standard.left_out
    modelfile.check_model(standard.train_model, base_dir=str(tmp_path))
    standard.save(tmp_path / "standard")
    trainers = Trainer(kernel), Trainer(str(tmp_path / "standard"))
    losses = [[t.step(batch) for t in trainers] for _ in range(4)]
    np.testing.assert_allclose(*zip(*losses), rtol=1e-5)
    assert losses[-1][0] < losses[0][0]
    np.testing.assert_allclose(*(t.evaluate(batch)["loss"] for t in trainers), rtol=1e-5)
    costs = [t.merge_cost(batch) for t in trainers]  # the merged tensors in the eval model's own form
    for key in ("adapted", "merged"):
        np.testing.assert_allclose(*(c[key] for c in costs), rtol=1e-5)
    for merge in (False, True):
        exported = [t.export(merge=merge) for t in trainers]
        assert all("MatMulNBits" in ops(m) for m in exported)
        outputs = [_session(m).run(None, {"x": batch["x"]})[0] for m in exported]
        np.testing.assert_allclose(*outputs, rtol=1e-5, atol=1e-6)


def test_shapes_are_inferred_through_matmulnbits():
    """onnx's inference knows no MatMulNBits: onnx_inferred infers its products as MatMuls, so a
    model quantized without value_info (MatMulNBits, Relu, MatMulNBits) gets the shapes after
    them, and the model itself is left as it was."""
    from onnx_autodiff.toolkit.inference import onnx_inferred

    proto, _ = nbits_model(4, False, False, 64, np.random.default_rng(0))
    graph = proto.graph
    first = graph.node[0]
    first.output[0] = "h"
    second = onnx.NodeProto()
    second.CopyFrom(first)
    second.input[0], second.output[0], second.name = "a", "y", "second"
    for attribute in second.attribute:
        if attribute.name == "K":
            attribute.i = 24
    graph.initializer.extend([numpy_helper.from_array(np.zeros((24, 2, 8), np.uint8), "B2"),
                              numpy_helper.from_array(np.ones(48, np.float32), "scales2")])
    second.input[1], second.input[2] = "B2", "scales2"
    graph.node.extend([helper.make_node("Relu", ["h"], ["a"]), second])
    graph.output[0].type.tensor_type.ClearField("shape")
    before = proto.SerializeToString()
    inferred = onnx_inferred(proto)
    assert proto.SerializeToString() == before
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*inferred.graph.value_info, *inferred.graph.output]}
    assert shapes == {"h": [2, 3, 24], "a": [2, 3, 24], "y": [2, 3, 24]}
    assert [n.op_type for n in inferred.graph.node] == ["MatMulNBits", "Relu", "MatMulNBits"]
    assert [v.name for v in inferred.graph.input] == [v.name for v in proto.graph.input]
