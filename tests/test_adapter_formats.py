"""LoRA adapters in the ecosystem's formats: peft's adapter directory both ways (peft itself is the
oracle: PeftModel.from_pretrained on the same base module), and onnxruntime's .onnx_adapter, one
session switching between adapters against the merged export of each."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_training import BATCH, IN, batches, mlp

from onnx_autodiff.cli import main
from onnx_autodiff.errors import TrainingError
from onnx_autodiff.training.lora import LoraConfig
from onnx_autodiff.training import Trainer, generate_artifacts

VOCAB, T = 64, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32: ours and peft's sum the same products in other orders
CPU = ["CPUExecutionProvider"]


def session(model) -> ort.InferenceSession:
    return ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(), providers=CPU)


def mlp_trainer(rank: int, alpha: float, lr: float, steps: int = 8) -> Trainer:
    trainer = Trainer(generate_artifacts(mlp(), lora=LoraConfig(rank=rank, alpha=alpha), optimizer="adamw",
                                         optimizer_options={"lr": lr}))
    data = list(batches(3))
    for i in range(steps):
        trainer.step(data[i % 3])
    return trainer


def run(shared: ort.InferenceSession, feeds, path=None) -> list[np.ndarray]:
    """``shared`` on ``feeds`` with the adapter in ``path`` active (None: none). The adapter must
    outlive the run: RunOptions keeps no reference to it (a collected one feeds freed memory)."""
    options, adapter = ort.RunOptions(), None
    if path is not None:
        adapter = ort.LoraAdapter()
        adapter.Load(str(path))
        options.add_active_adapter(adapter)
    outputs = shared.run(None, feeds, options)
    del adapter
    return outputs


# onnxruntime's .onnx_adapter: no torch needed


def test_one_session_switches_between_adapters(tmp_path):
    """Two adapters of different rank and alpha and none, in one session, in turn and back:
    each equals the merged export of its trainer, none the base model."""
    first, second = mlp_trainer(2, 4.0, 0.05), mlp_trainer(3, 3.0, 0.1)
    model = first.export_adapter_model(tmp_path / "adapters.onnx")
    onnx.checker.check_model(model, full_check=True)
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs == {"X": ["N", IN], "W1.lora_A": [IN, "lora_rank"], "W1.lora_B": ["lora_rank", 7],
                      "W2.lora_A": [7, "lora_rank"], "W2.lora_B": ["lora_rank", 3]}
    paths = [tmp_path / "first.onnx_adapter", tmp_path / "second.onnx_adapter"]
    first.save_onnx_adapter(paths[0])
    second.save_onnx_adapter(paths[1], adapter_version=7, model_version=3)
    written = ort.AdapterFormat.read_adapter(str(paths[1]))
    assert (written.get_adapter_version(), written.get_model_version()) == (7, 3)
    values = second.parameters()
    tensors = {name: value.numpy() for name, value in written.get_parameters().items()}
    assert sorted(tensors) == sorted(values)
    np.testing.assert_array_equal(tensors["W1.lora_A"], values["W1.lora_A"])
    np.testing.assert_allclose(tensors["W1.lora_B"], 1.0 * values["W1.lora_B"], rtol=1e-7)  # alpha/r = 3/3
    first_b = ort.AdapterFormat.read_adapter(str(paths[0])).get_parameters()["W2.lora_B"].numpy()
    np.testing.assert_allclose(first_b, 2.0 * first.parameters()["W2.lora_B"], rtol=1e-7)  # alpha/r = 4/2: B carries it
    assert np.abs(first_b).max() > 1e-3
    X = np.random.default_rng(5).standard_normal((BATCH, IN)).astype(np.float32)
    shared = session(str(tmp_path / "adapters.onnx"))
    wants = [session(t.export()).run(None, {"X": X})[0] for t in (first, second)]
    base = session(mlp()).run(None, {"X": X})[0]
    assert np.abs(wants[0] - wants[1]).max() > 1e-2 and np.abs(wants[0] - base).max() > 1e-2
    for path, want in ((paths[0], wants[0]), (None, base), (paths[1], wants[1]), (paths[0], wants[0])):
        np.testing.assert_allclose(run(shared, {"X": X}, path)[0], want, **TOL, err_msg=str(path))
    np.testing.assert_array_equal(shared.run(None, {"X": X})[0], base)  # no run options: the base model


def test_adapter_files_need_lora(tmp_path):
    trainer = Trainer(generate_artifacts(mlp(), optimizer="sgd"))
    for call in (lambda: trainer.save_onnx_adapter(tmp_path / "a.onnx_adapter"), trainer.export_adapter_model,
                 lambda: trainer.save_peft_adapter(tmp_path / "peft")):
        with pytest.raises(TrainingError, match="needs LoRA adapters: generate the artifacts with lora="):
            call()
    assert not list(tmp_path.iterdir())


def test_peft_needs_module_names(tmp_path):
    trainer = mlp_trainer(2, 2.0, 0.05, steps=1)
    with pytest.raises(TrainingError, match="adapters of W1, W2 have no module name"):
        trainer.save_peft_adapter(tmp_path / "peft")
    assert not (tmp_path / "peft").exists()


def test_train_command_writes_the_onnx_adapter(tmp_path, capsys):
    model, data = tmp_path / "mlp.onnx", tmp_path / "train.npz"
    onnx.save(mlp(), model)
    X, y = next(batches(1))
    np.savez(data, X=X, labels=y)
    out, adapter = tmp_path / "run", tmp_path / "run.onnx_adapter"
    assert main(["train", str(model), "--data", str(data), "-o", str(out), "--lora", "2", "--epochs", "3",
                 "--save-onnx-adapter", str(adapter)]) == 0
    assert f"{adapter}, {out / 'adapter_inputs.onnx'}:" in capsys.readouterr().out
    np.testing.assert_allclose(run(session(str(out / "adapter_inputs.onnx")), {"X": X}, adapter)[0],
                               session(str(out / "model.onnx")).run(None, {"X": X})[0], **TOL)
    # refused before training, one line each
    refused = [(["--save-onnx-adapter", str(adapter)], 2, "--save-onnx-adapter writes LoRA adapters: add --lora RANK"),
               (["--lora", "2", "--save-peft-adapter", str(tmp_path / "p")], 1, "have no module name"),
               (["--lora", "2", "--peft-strip", "lm."], 2, "--peft-strip needs --save-peft-adapter DIR"),
               (["--lora", "2", "--save-onnx-adapter", str(tmp_path)], 2, "is a directory")]
    for extra, code, message in refused:
        assert main(["train", str(model), "--data", str(data), "-o", str(tmp_path / "refused"), *extra]) == code
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "refused" / "checkpoint").exists()


# peft: a tiny Llama with random weights, exported as test_as_exported.py does


@pytest.fixture(scope="module")
def llama():
    """A builder of the module (a wrapper whose ``lm`` is a LlamaForCausalLM, returning the loss
    and the logits; the same random weights each time) and its dynamo export (optimize=True: the
    q_proj weight is a folded val_29)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")

    class LossAndLogits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            logits = self.lm(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
            return loss, logits

    def build():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                                          attn_implementation="eager")
        return LossAndLogits(transformers.LlamaForCausalLM(config)).eval()

    ids = torch.from_numpy(feeds(0)["ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(build(), (ids, ids), dynamo=True, optimize=True, verbose=False).model_proto
    return build, proto


def feeds(seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, (2, T)).astype(np.int64)
    return {"ids": ids, "labels": ids}


def artifacts(proto, requires_grad=None, **lora):
    return generate_artifacts(proto, loss=None, output=proto.graph.output[0].name, optimizer="adamw",
                              optimizer_options={"lr": 1e-2}, requires_grad=requires_grad,
                              lora=LoraConfig(**{"rank": 4, "alpha": 8, "targets": ["*q_proj*", "*v_proj*"], **lora}))


@pytest.fixture(scope="module")
def trained(llama):
    _, proto = llama
    trainer = Trainer(artifacts(proto))
    for step in range(3):
        trainer.step(feeds(step))
    return trainer


def logits_of(model, batch) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.from_numpy(batch["ids"])).logits.numpy()


def peft_saved(build, directory, r=4, alpha=8, targets=("q_proj", "v_proj"), seed=3):
    """A peft model on the LlamaForCausalLM with random, non-zero A and B, saved by peft."""
    import peft
    import torch

    model = peft.get_peft_model(build().lm, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.2
    model.save_pretrained(directory)
    return model.eval()


def test_peft_loads_our_adapter(llama, trained, tmp_path):
    """save_peft_adapter → PeftModel.from_pretrained on a fresh base: peft's logits are our merged
    export's, our unmerged one's and the adapter-input model's with our .onnx_adapter."""
    import peft

    build, _ = llama
    config = trained.save_peft_adapter(tmp_path / "ours", config={"task_type": "CAUSAL_LM"})
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written == config
    assert {k: written[k] for k in ("peft_type", "r", "lora_alpha", "target_modules", "fan_in_fan_out", "bias", "task_type")} \
        == {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "fan_in_fan_out": False, "bias": "none", "task_type": "CAUSAL_LM"}
    batch = feeds(9)
    theirs = logits_of(peft.PeftModel.from_pretrained(build().lm, tmp_path / "ours").eval(), batch)
    base = logits_of(build().lm, batch)
    assert np.abs(theirs - base).max() > 1e-2  # the adapters moved the logits: an unloaded adapter fails below
    for model in (trained.export(), trained.export(merge=False)):
        np.testing.assert_allclose(session(model).run(None, batch)[1], theirs, **TOL)
    trained.save_onnx_adapter(tmp_path / "ours.onnx_adapter")
    shared = session(trained.export_adapter_model())
    np.testing.assert_allclose(run(shared, batch, tmp_path / "ours.onnx_adapter")[1], theirs, **TOL)
    np.testing.assert_allclose(shared.run(None, batch)[1], base, **TOL)
    # strip="": the names as exported, for peft wrapping the wrapper itself
    trained.save_peft_adapter(tmp_path / "whole", strip="")
    import torch

    with torch.no_grad():
        whole = peft.PeftModel.from_pretrained(build(), tmp_path / "whole").eval()(
            torch.from_numpy(batch["ids"]), torch.from_numpy(batch["labels"]))[1].numpy()
    np.testing.assert_allclose(whole, theirs, **TOL)


def test_load_what_peft_saved(llama, tmp_path):
    """A peft adapter with non-zero B: our eval after load_peft_adapter is peft's model; a step
    then trains from it; our own save loads back exactly."""
    build, proto = llama
    model = peft_saved(build, tmp_path / "peft")
    trainer = Trainer(artifacts(proto))
    trainer.load_peft_adapter(tmp_path / "peft")
    batch = feeds(4)
    ours = trainer.evaluate(batch)
    np.testing.assert_allclose(ours[trainer.layout["eval"]["outputs"][0]], logits_of(model, batch), **TOL)
    assert np.abs(logits_of(model, batch) - logits_of(build().lm, batch)).max() > 1e-2
    loss = trainer.step(batch)
    np.testing.assert_allclose(loss, ours["loss"], rtol=1e-6)  # the step starts from the loaded adapters
    again = Trainer(artifacts(proto))
    trainer.save_peft_adapter(tmp_path / "back")
    again.load_peft_adapter(tmp_path / "back")
    for name, value in trainer.parameters().items():
        np.testing.assert_array_equal(again.parameters()[name], value, err_msg=name)


def test_load_refuses_what_does_not_fit(llama, tmp_path):
    """Rank, scale, missing and extra modules, a wrong prefix: one error each, naming what, and
    nothing changed."""
    build, proto = llama
    trainer = Trainer(artifacts(proto))
    before = trainer.parameters()
    cases = [
        ({"r": 2, "alpha": 4}, {},
         "has rank r=2; the artifacts' adapters have rank 4: generate them with LoraConfig(rank=2, alpha=4)"),
        ({"alpha": 16}, {}, "scales its adapters by lora_alpha/r = 4; the artifacts' scale is alpha/rank = 2"),
        ({"targets": ("q_proj",)}, {}, "lacks 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight'"),
        ({"targets": ("q_proj", "k_proj", "v_proj")}, {}, "also holds base_model.model.model.layers.0.self_attn.k_proj"),
        ({}, {"strip": ""}, "lacks 'base_model.model.lm.model.layers.0.self_attn.q_proj.lora_A.weight'"),
        ({}, {"strip": "body."}, "does not start with strip='body.'"),
    ]
    for number, (saved, options, message) in enumerate(cases):
        directory = tmp_path / str(number)
        peft_saved(build, directory, **saved)
        with pytest.raises(TrainingError, match=re.escape(message)):
            trainer.load_peft_adapter(directory, **options)
    with pytest.raises(TrainingError, match="holds no adapter_config.json"):
        trainer.load_peft_adapter(tmp_path)
    for name, value in trainer.parameters().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    extras = Trainer(artifacts(proto, requires_grad=["lm.model.norm.weight"]))  # a head or norm trained beside
    with pytest.raises(TrainingError, match=r"also train lm\.model\.norm\.weight \(train_biases, train_norms or requires_grad\)"):
        extras.save_peft_adapter(tmp_path / "extras")
    assert not (tmp_path / "extras").exists()


def test_train_command_writes_the_peft_adapter(llama, tmp_path, capsys):
    import peft

    build, proto = llama
    model, data = tmp_path / "llama.onnx", tmp_path / "train.npz"
    onnx.save(proto, model)
    np.savez(data, **{k: np.concatenate([feeds(s)[k] for s in range(2)]) for k in ("ids", "labels")})
    out = tmp_path / "run"
    assert main(["train", str(model), "--data", str(data), "-o", str(out), "--loss", "none",
                 "--output-name", proto.graph.output[0].name, "--lora", "4",
                 "--lora-alpha", "8", "--lora-targets", "*q_proj*", "*v_proj*", "--batch-size", "2", "--epochs", "2",
                 "--save-peft-adapter", str(tmp_path / "peft")]) == 0
    assert str(tmp_path / "peft") in capsys.readouterr().out
    batch = feeds(9)
    theirs = logits_of(peft.PeftModel.from_pretrained(build().lm, tmp_path / "peft").eval(), batch)
    np.testing.assert_allclose(session(str(out / "model.onnx")).run(None, batch)[1], theirs, **TOL)
    assert np.abs(theirs - logits_of(build().lm, batch)).max() > 1e-3


def test_gpt2_conv1d_is_fan_in_fan_out(tmp_path):
    """GPT-2's Conv1D multiplies by its weight as stored ([in, out]): peft's fan_in_fan_out, and
    the same lora_A [r, in] / lora_B [out, r] keys; loaded back, the values are ours exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def build():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                         attn_implementation="eager", bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()

    class Loss(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            logits = self.lm(input_ids=ids).logits
            return (logits ** 2).mean(), logits

    batch = feeds(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(Loss(build()), (torch.from_numpy(batch["ids"]),), dynamo=True, optimize=False,
                                  verbose=False).model_proto
    trainer = Trainer(generate_artifacts(proto, loss=None, output=proto.graph.output[0].name, optimizer="adamw",
                                         optimizer_options={"lr": 1e-2},
                                         lora=LoraConfig(rank=2, targets=["*c_attn*", "*c_fc*"])))
    for _ in range(3):
        trainer.step({"ids": batch["ids"]})
    config = trainer.save_peft_adapter(tmp_path / "gpt2")
    assert (config["target_modules"], config["fan_in_fan_out"], config["lora_alpha"]) == (["c_attn", "c_fc"], True, 2)
    theirs = logits_of(peft.PeftModel.from_pretrained(build(), tmp_path / "gpt2").eval(), batch)
    assert np.abs(theirs - logits_of(build(), batch)).max() > 1e-2
    np.testing.assert_allclose(session(trainer.export()).run(None, {"ids": batch["ids"]})[1], theirs, **TOL)
    values = trainer.parameters()
    trainer.load_peft_adapter(tmp_path / "gpt2")
    for name, value in trainer.parameters().items():
        np.testing.assert_array_equal(value, values[name], err_msg=name)
