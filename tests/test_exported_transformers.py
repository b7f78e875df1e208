"""Exported transformers train and differentiate their module's parameters by default, not the
exporter's constants (Pow exponents, epsilons, scale factors, causal masks)."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff import hvp
from onnx_autodiff.training import Trainer, generate_artifacts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, T, BATCH = 64, 8, 2


class LossOf(torch.nn.Module):
    """A causal LM whose output is its next-token loss, in the model's dtype (transformers' own
    loss casts the logits to float32)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        logits = self.lm(input_ids=ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def build(family: str, dtype=torch.float32) -> LossOf:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                         attn_implementation="eager")
        lm = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=16, attn_implementation="eager")
        lm = transformers.LlamaForCausalLM(config)
    return LossOf(lm).to(dtype).eval()


def export(module, optimize: bool) -> onnx.ModelProto:
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (ids, ids), dynamo=True, optimize=optimize, verbose=False)
    return program.model_proto


def batch(seed: int):
    ids = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, T)).astype(np.int64)
    return {"ids": ids, "labels": ids}


_EXPORTS = {}


def exported(family: str, optimize: bool, dtype=torch.float32):
    key = (family, optimize, dtype)
    if key not in _EXPORTS:
        module = build(family, dtype)
        _EXPORTS[key] = module, export(module, optimize)
    return _EXPORTS[key]


def module_parameter_names(module) -> set[str]:
    return {name for name, _ in module.named_parameters(remove_duplicate=False)}  # tied ones too


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("optimize", [True, False])
def test_default_artifacts_train_exactly_the_module_parameters(family, optimize):
    """Every module parameter the file holds, under whatever name (a folded transpose, one tensor
    for several parameters of equal value), and none of the exporter's constants; tests/
    test_as_exported.py checks the values against torch.optim."""
    module, proto = exported(family, optimize)
    artifacts = generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options={"lr": 1e-2})
    modules = {e["initializer"]: [e["name"], *e["aliases"]] for e in artifacts.layout["modules"]}
    trained = {n for p in artifacts.params for n in modules[p]}
    folded = {"lm.transformer.wpe.weight"} if (family, optimize) == ("gpt2", True) else set()  # positions folded
    tensors = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        tensors.setdefault(id(parameter), set()).add(name)  # a tied one under both names
    assert trained <= module_parameter_names(module)
    assert {n for names in tensors.values() if not names & trained for n in names} == folded
    assert artifacts.left_out == sorted(set(artifacts.left_out), key=artifacts.left_out.index)
    assert not set(artifacts.left_out) & set(artifacts.params)
    trainer = Trainer(artifacts)
    losses = [trainer.step(batch(0)) for _ in range(8)]
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < 0.9 * losses[0], losses
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    trained_file = {t.name: onnx.numpy_helper.to_array(t) for t in trainer.export().graph.initializer}
    changed = {name for name, array in initializers.items() if not np.array_equal(trained_file[name], array)}
    holders = {e["initializer"] for e in artifacts.layout["modules"]} | {
        c for e in artifacts.layout["modules"] for c, _ in e["copies"]}
    assert changed == holders & set(initializers)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_default_artifacts_follow_torch_adamw(family):
    """Exported with optimize=False (every parameter stays an initializer of its own), the
    default artifacts take the same AdamW steps as torch.optim on the module."""
    module, proto = exported(family, optimize=False)
    trainer = Trainer(generate_artifacts(proto, loss=None, optimizer="adamw", optimizer_options={"lr": 1e-2}))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for step in range(3):
        feeds = batch(step)
        ours = trainer.step(feeds)
        optimizer.zero_grad()
        theirs = module(torch.from_numpy(feeds["ids"]), torch.from_numpy(feeds["labels"]))
        theirs.backward()
        optimizer.step()
        np.testing.assert_allclose(ours, theirs.item(), rtol=2e-4)
    # Adam divides by |g|: where a gradient is float32 noise, its sign and so the step differ.
    trained = trainer.parameters()
    for name, parameter in module.named_parameters():
        if name in trained:
            np.testing.assert_allclose(trained[name], parameter.detach().numpy(), rtol=1e-3, atol=2e-4)


def _run(proto, feeds):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in proto.graph.output]
    wanted = {i.name for i in proto.graph.input}
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def test_hvp_with_defaults_is_finite_on_an_optimized_export():
    """optimize=True stores the tanh-GELU exponent 3.0 as an initializer; its partial is NaN
    for negative bases, and 0·NaN made every Hessian-vector product NaN when it was a variable."""
    module, proto = exported("gpt2", optimize=True, dtype=torch.float64)
    result = hvp(proto, of=proto.graph.output[0].name)
    directions = [i for i in result.graph.input if i.name.startswith("v_")]
    assert directions
    exponents = [t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.DOUBLE and not t.dims]
    assert exponents and not {f"v_{name}" for name in exponents} & {i.name for i in directions}
    rng = np.random.default_rng(0)
    feeds = dict(batch(0))
    shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    for direction in directions:
        feeds[direction.name] = rng.standard_normal(shapes[direction.name[2:]])
    outputs = _run(result, feeds)
    products = {k: v for k, v in outputs.items() if k.startswith("hvp_")}
    assert len(products) == len(directions)
    assert all(np.isfinite(v).all() for v in products.values())


def test_hvp_with_defaults_matches_torch():
    """GPT-2, not Llama: Llama's eager attention takes its softmax in float32 even in a float64 model."""
    module, proto = exported("gpt2", optimize=False, dtype=torch.float64)
    result = hvp(proto, of=proto.graph.output[0].name)
    parameters = dict(module.named_parameters(remove_duplicate=False))
    names = [i.name[2:] for i in result.graph.input if i.name.startswith("v_")]
    assert set(names) == set(parameters) & {t.name for t in proto.graph.initializer}
    rng = np.random.default_rng(0)
    directions = {name: rng.standard_normal(tuple(parameters[name].shape)) for name in names}
    feeds = dict(batch(0), **{f"v_{name}": v for name, v in directions.items()})
    outputs = _run(result, feeds)
    ids = torch.from_numpy(feeds["ids"])

    def loss(*values):
        return torch.func.functional_call(module, dict(zip(names, values)), (ids, ids))

    _, expected = torch.autograd.functional.hvp(
        loss, tuple(parameters[n].detach() for n in names), tuple(torch.from_numpy(directions[n]) for n in names)
    )
    # The exporter rounds Python-float constants (GELU's 0.044715) to float32 before casting
    # them to double: differences of 1e-8 of each product's scale.
    for name, product in zip(names, expected):
        expected = product.numpy()
        np.testing.assert_allclose(outputs[f"hvp_{name}"], expected, rtol=1e-6, atol=1e-7 * np.abs(expected).max())
