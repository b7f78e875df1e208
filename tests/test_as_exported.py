"""Exports trained as they are exported: dynamo with optimize=True and False, and TorchScript files
with constant folding, train their module's parameters as torch.optim does on the module.

The oracle is the module itself, trained by torch.optim.AdamW beside the artifacts; the module
names come from the files (recovered), never from the module."""

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.weights.recovery import recover_parameters
from onnx_autodiff.training import Trainer, generate_artifacts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_exported_transformers import VOCAB, LossOf, batch  # noqa: E402
from test_exported_transformers import build as build_causal  # noqa: E402

KINDS = ["optimize", "plain", "torchscript"]  # dynamo optimize=True, dynamo optimize=False, TorchScript
# What optimize=True folds with the static positions of these exports: an embedding gathered at
# constant indices is a constant computed from the parameter, not recoverable (the file does not
# hold the parameter, nor which rows were read how often).
FOLDED_EMBEDDINGS = {
    "gpt2": {"lm.transformer.wpe.weight"},
    "bert": {"lm.bert.embeddings.position_embeddings.weight", "lm.bert.embeddings.token_type_embeddings.weight"},
    "llama": set(),
}


class MaskedLoss(LossOf):
    """A masked LM whose output is its loss over every position."""

    def forward(self, ids, labels):
        logits = self.lm(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(family: str):
    if family in ("gpt2", "llama"):  # GPT-2 with its embedding and head tied
        return build_causal(family)
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     vocab_size=VOCAB, max_position_embeddings=16, attn_implementation="eager",
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return MaskedLoss(transformers.BertForMaskedLM(config)).eval()


def export(module, kind: str) -> onnx.ModelProto:
    ids = torch.from_numpy(batch(0)["ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "torchscript":
            stream = io.BytesIO()
            torch.onnx.export(module, (ids, ids), stream, dynamo=False, do_constant_folding=True,
                              input_names=["ids", "labels"])
            return onnx.load_from_string(stream.getvalue())
        program = torch.onnx.export(module, (ids, ids), dynamo=True, optimize=kind == "optimize", verbose=False)
    return program.model_proto


_EXPORTS = {}


def exported(family: str, kind: str):
    """A fresh module and its export (the export made once per family and kind)."""
    if (family, kind) not in _EXPORTS:
        _EXPORTS[family, kind] = export(build(family), kind)
    return build(family), _EXPORTS[family, kind]


def feeds_for(proto, step):
    names = {i.name for i in proto.graph.input}
    return {k: v for k, v in batch(step).items() if k in names}


def distinct_parameters(module) -> list[list[str]]:
    """The module's parameters, each with all its names (a tied one has two)."""
    names = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return list(names.values())


def _run_torch(module, feeds, optimizer):
    optimizer.zero_grad()
    loss = module(torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"]))
    loss.backward()
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_default_training_is_torch_adamw_on_the_module(family, kind):
    module, proto = exported(family, kind)
    artifacts = generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options={"lr": 1e-2})
    trainer = Trainer(artifacts)
    state = trainer.module_state_dict()
    unrecovered = [names for names in distinct_parameters(module) if not any(n in state for n in names)]
    expected = FOLDED_EMBEDDINGS[family] if kind == "optimize" else set()
    assert {n for names in unrecovered for n in names} == expected
    for names in unrecovered:  # stays a constant here: frozen in torch too
        module.get_parameter(names[0]).requires_grad_(False)
    # the module-name view is the module's state_dict before training, tied names included
    reference = module.state_dict()
    assert set(state) <= set(reference)
    for name, value in state.items():
        np.testing.assert_array_equal(value, reference[name].numpy(), err_msg=name)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        feeds = feeds_for(proto, step)
        ours = trainer.step(feeds)
        theirs = _run_torch(module, batch(step), optimizer)
        np.testing.assert_allclose(ours, theirs, rtol=2e-5)
    state, reference = trainer.module_state_dict(), module.state_dict()
    changed = 0
    for name, value in state.items():
        # Adam divides by |g|: where a gradient is float32 noise its sign, and so the step, may differ
        np.testing.assert_allclose(value, reference[name].numpy(), rtol=1e-3, atol=2e-4, err_msg=name)
        changed += not np.array_equal(value, build(family).state_dict()[name].numpy())
    assert changed == len(state)  # every recovered parameter trained (ties under each name)


@pytest.mark.parametrize("kind", KINDS)
def test_export_keeps_the_files_layout_and_loads_into_the_module(kind):
    """GPT-2: the tied head's copy in the file (a folded transpose or TorchScript's constant) is
    written from the trained embedding; the module-name view loads into the module."""
    module, proto = exported("gpt2", kind)
    trainer = Trainer(generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options={"lr": 1e-2}))
    for step in range(2):
        trainer.step(feeds_for(proto, step))
    result = trainer.export()
    names = [t.name for t in proto.graph.initializer]
    assert [t.name for t in result.graph.initializer][: len(names)] == names  # the file's names, in its order
    onnx.checker.check_model(result, full_check=True)
    state = {k: torch.from_numpy(np.array(v)) for k, v in trainer.module_state_dict().items()}
    fresh = build("gpt2")
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected
    buffers = set(fresh.state_dict()) - {n for n, _ in fresh.named_parameters(remove_duplicate=False)}
    loaded_ties = {n for names in distinct_parameters(fresh) if set(names) & set(state) for n in names}
    assert set(missing) - loaded_ties == buffers | (FOLDED_EMBEDDINGS["gpt2"] if kind == "optimize" else set())
    # and back: a new trainer takes the module's state by module name
    again = Trainer(generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options={"lr": 1e-2}))
    again.load_module_state_dict({k: v.numpy() for k, v in fresh.state_dict().items()})
    for name, value in trainer.module_state_dict().items():
        np.testing.assert_array_equal(again.module_state_dict()[name], value, err_msg=name)
    with pytest.raises(Exception, match="has shape"):
        again.load_module_state_dict({k: v.numpy()[..., :1] for k, v in fresh.state_dict().items()})
    # the exported file computes what the module with the loaded state computes (the folded wpe
    # keeps its initial values in both)
    session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
    exported_loss = session.run(None, feeds_for(proto, 5))[0]
    with torch.no_grad():
        ids = torch.from_numpy(batch(5)["ids"])
        np.testing.assert_allclose(exported_loss, fresh(ids, ids).item(), rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_by_module_name_is_peft(kind):
    """LoRA on '*q_proj*' and '*v_proj*' adapts the modules peft adapts, and three AdamW steps
    agree given the same initial A, whatever the file calls the weights (val_29, onnx::MatMul_559)."""
    peft = pytest.importorskip("peft")
    module, proto = exported("llama", kind)
    options = {"lr": 1e-2, "weight_decay": 0.1}
    artifacts = generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options=options,
                                   lora=LoraConfig(rank=4, alpha=8, targets=["*q_proj*", "*v_proj*"]))
    adapted = {a["weight"]: a for a in artifacts.layout["lora"]["adapters"]}
    by_initializer = {e["initializer"]: e["name"] for e in artifacts.layout["modules"]}
    ours = {by_initializer[w].removesuffix(".weight"): a for w, a in adapted.items()}
    model = peft.get_peft_model(module, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0))
    theirs = {name.removeprefix("base_model.model."): layer for name, layer in model.named_modules()
              if isinstance(layer, peft.tuners.lora.LoraLayer)}
    assert set(ours) == set(theirs) and len(ours) == 4
    for name, adapter in ours.items():  # ours is [in, r], peft's lora_A.weight [r, in]
        theirs[name].lora_A["default"].weight.data = torch.from_numpy(artifacts.checkpoint[adapter["A"]].T.copy())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **options)
    trainer = Trainer(artifacts)
    for step in range(3):
        loss = trainer.step(feeds_for(proto, step))
        np.testing.assert_allclose(loss, _run_torch(model, batch(step), optimizer), rtol=1e-5)
    values = trainer.parameters()
    for name, adapter in ours.items():
        for part in ("A", "B"):
            want = getattr(theirs[name], f"lora_{part}")["default"].weight.detach().numpy().T
            np.testing.assert_allclose(values[adapter[part]], want, rtol=1e-4, atol=1e-6, err_msg=f"{name} {part}")
    merged = trainer.module_state_dict()  # the module's layout, adapters merged as peft merges them
    model.merge_adapter()
    for name in ours:
        np.testing.assert_allclose(merged[f"{name}.weight"], theirs[name].base_layer.weight.detach().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_requires_grad_and_frozen_take_module_names():
    _, proto = exported("llama", "optimize")
    artifacts = generate_artifacts(proto, loss=None, optimizer="sgd", requires_grad=["*.mlp.*", "lm.model.norm.weight"],
                                   frozen_params=["*down_proj*"])
    modules = {e["initializer"]: e["name"] for e in artifacts.layout["modules"]}
    trained = sorted(modules[p] for p in artifacts.params)
    assert trained == sorted(["lm.model.norm.weight", *(f"lm.model.layers.{i}.mlp.{p}_proj.weight"
                                                         for i in range(2) for p in ("gate", "up"))])
    with pytest.raises(Exception, match="matches no module parameter"):
        generate_artifacts(proto, loss=None, optimizer="sgd", requires_grad=["*nothing*"])


def test_an_export_with_lora_is_converted_to_onnx_ir_once_per_model(monkeypatch):
    """Recovery and LoRA work on onnx-ir: the export is converted once, for the model to train,
    whose copy is the inference model (its own layout, its base stored as the train model's), and
    the train build goes on with that model; the conversion back to protobuf happens at the end."""
    import onnx_ir as ir

    _, proto = exported("llama", "optimize")
    converted = []
    convert = ir.from_proto
    monkeypatch.setattr(ir, "from_proto", lambda p: converted.append(len(p.graph.node)) or convert(p))
    artifacts = generate_artifacts(proto, loss=None, optimizer="sgd",
                                   lora=LoraConfig(rank=4, targets=["*q_proj*"], quantize_base="float16"))
    assert len(converted) == 1, converted
    assert artifacts.layout["lora"]["adapters"] and artifacts.layout["modules"]
    stored = {t.name: t.data_type for t in artifacts.inference_model.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in stored.values()  # the inference model stores the base as trained


def test_recovery_reads_each_export_alike():
    """The three exports of one module give the same module names and shapes."""
    found = {}
    for kind in KINDS:
        _, proto = exported("llama", kind)
        recovery = recover_parameters(__import__("onnx_ir").from_proto(proto))
        found[kind] = {p.name: p.shape for p in recovery.parameters}
    module = build("llama")
    assert found["optimize"] == found["plain"] == found["torchscript"] == {
        n: tuple(p.shape) for n, p in module.named_parameters()}


def test_grad_with_the_defaults_differentiates_the_folded_weights():
    """grad's default variables on an optimize=True export are the file's tensors that hold the
    parameters: a folded weight's gradient is torch's gradient of the weight, transposed."""
    import onnx_ir as ir

    from onnx_autodiff import autodiff_pass

    module, proto = exported("llama", "optimize")
    model = ir.from_proto(proto)
    autodiff = autodiff_pass(of=proto.graph.output[0].name, wrt=None)
    result = ir.to_proto(ir.passes.PassManager([autodiff])(model).model)
    recovery = recover_parameters(ir.from_proto(proto))
    holders = {p.initializer for p in recovery.parameters}
    assert set(autodiff.gradient_names) == holders
    session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in result.graph.output], session.run(None, feeds_for(proto, 0))))
    feeds = batch(0)
    module(torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"])).backward()
    grads = {name: p.grad.numpy() for name, p in module.named_parameters()}
    for p in recovery.parameters:
        ours = outputs[autodiff.gradient_names[p.initializer]]
        shared = [q.name for q in recovery.parameters if q.initializer == p.initializer]
        want = sum(grads[n] for n in shared)  # a tensor stored for several parameters: their sum
        np.testing.assert_allclose(p.module_value(ours), want, rtol=2e-3, atol=1e-5, err_msg=p.name)


def test_params_command(tmp_path, capsys):
    import json

    from onnx_autodiff.cli import main

    _, proto = exported("gpt2", "optimize")
    path = tmp_path / "gpt2.onnx"
    onnx.save(proto, path)
    assert main(["params", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["module", "parameter", "initializer", "transform"]
    assert lines[-1].startswith("27 module parameters (27 trained by default)")
    head = next(line for line in lines if line.startswith("lm.lm_head.weight "))
    assert "copy in val_" in head and "trained" in head
    assert main(["params", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    restored = [r for r in rows if r["found_by"].startswith("restored")]
    assert {r["name"] for r in restored} == {f"lm.transformer.h.{i}.{m}.bias" for i in range(2)
                                             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    folded = [r for r in rows if r["name"] is None and "lm.transformer.wpe.weight" in r["why"]]
    assert len(folded) == 1 and not folded[0]["trained"]


def test_artifacts_command_lora_targets_by_module_name(tmp_path, capsys):
    from onnx_autodiff.cli import main
    from onnx_autodiff.training import TrainingArtifacts

    _, proto = exported("llama", "torchscript")
    path = tmp_path / "llama.onnx"
    onnx.save(proto, path)
    out = tmp_path / "artifacts"
    assert main(["artifacts", str(path), "-o", str(out), "--loss", "none", "--lora", "4",
                 "--lora-targets", "*q_proj*", "*v_proj*"]) == 0
    assert "LoRA rank 4 on 4 weights" in capsys.readouterr().out
    artifacts = TrainingArtifacts.load(out)
    assert sorted(artifacts.params) == sorted(f"lm.model.layers.{i}.self_attn.{p}_proj.weight.lora_{m}"
                                              for i in range(2) for p in ("q", "v") for m in "AB")
    assert main(["artifacts", str(path), "-o", str(tmp_path / "none"), "--loss", "none", "--lora", "4",
                 "--lora-targets", "*nothing*"]) == 2
    assert "matches no weight" in capsys.readouterr().err


def test_a_dynamic_sequence_length_keeps_the_position_embeddings():
    """What docs/training.md advises for the embeddings a static export folds: with the sequence
    length dynamic, optimize=True keeps every parameter recoverable."""
    import onnx_ir as ir

    module = build("gpt2")
    ids = torch.from_numpy(batch(0)["ids"])
    seq = torch.export.Dim("seq", min=2, max=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(module, (ids, ids), dynamo=True, optimize=True, verbose=False,
                                  dynamic_shapes=({1: seq}, {1: seq})).model_proto
    recovery = recover_parameters(ir.from_proto(proto))
    found = {n for p in recovery.parameters for n in (p.name, *p.aliases)}
    assert all(set(names) & found for names in distinct_parameters(module))
    assert not any("computed from" in why for why in recovery.constants.values())


def test_zero_biases_the_optimizer_dropped_are_trained():
    """optimize=True drops a zero bias (a Conv's B, a Gemm's C); torch trains it."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 4, 3)
            self.fc = torch.nn.Linear(4, 3)
            for layer in (self.conv, self.fc):
                torch.nn.init.zeros_(layer.bias)

        def forward(self, x, target):
            h = torch.tanh(self.conv(x)).mean((2, 3))
            return ((self.fc(h) - target) ** 2).mean()

    torch.manual_seed(0)
    net = Net()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 2, 5, 5)).astype(np.float32),
             "target": rng.standard_normal((2, 3)).astype(np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(net, tuple(torch.from_numpy(v) for v in feeds.values()), dynamo=True,
                                  optimize=True, verbose=False).model_proto
    read = {i for node in proto.graph.node for i in node.input}
    assert not {"conv.bias", "fc.bias"} & read  # dropped by the exporter
    artifacts = generate_artifacts(proto, loss=None, optimizer="sgd", optimizer_options={"lr": 0.5})
    trainer = Trainer(artifacts)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    names = [i.name for i in proto.graph.input]
    for _ in range(3):
        ours = trainer.step(dict(zip(names, feeds.values())))
        optimizer.zero_grad()
        theirs = net(*(torch.from_numpy(v) for v in feeds.values()))
        theirs.backward()
        optimizer.step()
        np.testing.assert_allclose(ours, theirs.item(), rtol=1e-5)
    state = trainer.module_state_dict()
    assert set(state) == {n for n, _ in net.named_parameters()}
    for name, parameter in net.named_parameters():
        assert np.abs(parameter.detach().numpy()).max() > 0
        np.testing.assert_allclose(state[name], parameter.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_norm_fused_into_a_conv_is_trained_as_stored(kind):
    """Both exporters fold an inference-mode BatchNormalization into the Conv before it; the Conv's
    weight is then neither the module's conv weight nor anything else that torch trains: it is
    trained as stored, and said to be fused."""
    import onnx_ir as ir

    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    x = torch.randn(1, 2, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "torchscript":
            stream = io.BytesIO()
            torch.onnx.export(net, (x,), stream, dynamo=False)
            proto = onnx.load_from_string(stream.getvalue())
        else:
            proto = torch.onnx.export(net, (x,), dynamo=True, optimize=kind == "optimize", verbose=False).model_proto
    recovery = recover_parameters(ir.from_proto(proto))
    if kind == "plain":
        assert {p.name for p in recovery.parameters} == {"0.weight", "0.bias", "1.weight", "1.bias"}
        return
    assert not recovery.constants
    assert len(recovery.parameters) == 2 and not any(p.module for p in recovery.parameters)
    assert all("batch normalization folded into it" in p.found_by for p in recovery.parameters)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_the_rewrite_of_an_export_is_a_fixed_point(family):
    """Recovery on the rewritten (tied) model finds what the rewrite made: BERT's split decoder
    bias is read by an Add whose fx call's weight now arrives through a Transpose."""
    import onnx_ir as ir

    from onnx_autodiff.weights.recovery import RecoverParametersPass

    _, proto = exported(family, "optimize")
    model = ir.from_proto(proto)
    rewrite = RecoverParametersPass(tie=True)
    rewrite(model)
    again = recover_parameters(model)
    assert sorted((p.name, p.initializer, p.transposed) for p in again.parameters) == sorted(
        (p.name, p.initializer, p.transposed) for p in rewrite.recovered)
