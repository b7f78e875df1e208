"""Stored oracle references: round trip, fingerprints, fallback to the live oracle, CLI options."""

import argparse

import numpy as np
import pytest

from onnx_autodiff.conformance import runner
from onnx_autodiff.rules import default_registry

OPS = ["Add", "Max", "Relu", "Softmax"]  # smooth, broadcasting, several inputs
KINKS = ["test_maxpool_3d_dilations"]  # ties: stored as kink intervals


@pytest.fixture(scope="module")
def cases():
    every = runner.load_node_cases()
    return runner.select_cases(every, ops=OPS) + runner.select_cases(every, names=KINKS)


@pytest.fixture(scope="module")
def recorded(cases):
    save = runner.References()
    results = runner.run_cases(cases, save=save)
    return results, save


def parse(argv):
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    return parser.parse_args(argv)


def test_round_trip_keeps_every_field(recorded, tmp_path):
    _, save = recorded
    path = save.save(tmp_path / "refs.npz")
    loaded = runner.References.load(path)
    assert set(loaded.entries) == set(save.entries) and len(save) > 10
    kinks = 0
    for key, entry in save.entries.items():
        again = loaded.entries[key]
        assert (again.fingerprint, again.backend, again.weak, again.f0) == (
            entry.fingerprint, entry.backend, entry.weak, entry.f0)
        assert set(again.details) == set(entry.details)
        for x, detail in entry.details.items():
            other = again.details[x]
            for flag in ("evaluated", "kink", "unstable", "discontinuous", "nonfinite", "shape_changed", "one_sided"):
                np.testing.assert_array_equal(getattr(other, flag), getattr(detail, flag), err_msg=f"{key} {x} {flag}")
            for field in ("value", "lower", "upper"):
                stored, original = getattr(other, field), getattr(detail, field)
                evaluated = detail.evaluated
                # float32 storage for float32 gradients: 7 significant digits are kept
                np.testing.assert_allclose(stored[evaluated], original[evaluated], rtol=1e-7, atol=1e-30)
                assert np.all(np.isnan(stored[~evaluated]))
            kinks += int(detail.kink.sum())
    assert kinks > 0  # MaxPool's ties went through the kink intervals


def test_stored_comparison_matches_the_live_one(cases, recorded):
    live, save = recorded
    stored = runner.run_cases(cases, references=save)
    assert [(r.case, r.input, r.status) for r in stored] == [(r.case, r.input, r.status) for r in live]
    assert {r.source for r in stored if r.status == "pass"} == {"stored"}
    for a, b in zip(live, stored):
        if a.error is not None:
            assert b.error == pytest.approx(a.error, rel=1e-2, abs=1e-3)


def test_stored_values_catch_a_wrong_rule(cases, recorded):
    _, save = recorded
    registry = default_registry().copy()

    @registry.register("Add", differentiable=("A", "B"), broadcast=True, since=7)
    def wrong_add(op, node, dY):
        return {"A": dY, "B": op.Mul(dY, 1.01)}

    results = runner.run_cases(runner.select_cases(cases, names=["test_add"]), registry, references=save)
    found = {r.input: (r.status, r.source) for r in results}
    assert found == {"x": ("pass", "stored"), "y": ("fail", "stored")}


def test_missing_or_stale_entries_use_the_live_oracle(cases, recorded):
    _, save = recorded
    partial = runner.References({k: v for k, v in save.entries.items() if k[0] != "test_relu"})
    stale = partial.get("test_add")
    partial.put("test_add", runner.StoredOracle("0" * 16, stale.backend, stale.weak, stale.f0, None,
                                                 {x: d for x, d in stale.details.items()}))
    chosen = runner.select_cases(cases, names=["test_relu", "test_add", "test_max_example"])
    results = runner.run_cases(chosen, references=partial)
    sources = {(r.case, r.input): r.source for r in results}
    assert sources[("test_relu", "x")] == "live"
    assert sources[("test_add", "x")] == "live (stale reference)"
    assert {s for (c, _), s in sources.items() if c == "test_max_example"} == {"stored"}
    assert all(r.status == "pass" for r in results)
    # another seed or onnx version is another key
    assert save.get("test_add", seed=1) is None and save.get("test_add", onnx_version="0.0") is None


def test_cli_saves_and_reads_references(tmp_path, capsys):
    path = tmp_path / "refs.npz"
    assert runner.run(parse(["--case", "test_add", "test_relu", "--save-references", str(path)])) == 0
    out = capsys.readouterr().out
    assert "references: 2 entries" in out and path.is_file()
    # saving again with other cases keeps the entries already in the file
    assert runner.run(parse(["--case", "test_sigmoid", "--save-references", str(path)])) == 0
    assert "references: 3 entries" in capsys.readouterr().out
    assert runner.run(parse(["--case", "test_add", "test_tanh", "--references", str(path)])) == 0
    out = capsys.readouterr().out
    assert "2 checks from stored values, 1 with the live oracle" in out
    assert "live: test_tanh [x]" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--case", "test_add", "--references", "/nonexistent/refs.npz"], "does not exist"),
        (["--case", "test_add", "--save-references", "/nonexistent/dir/refs.npz"], "does not exist"),
        (["--case", "test_add", "--references", "a.npz", "--save-references", "b.npz"], "not both"),
    ],
)
def test_bad_reference_options_exit_2(argv, needle, capsys):
    assert runner.run(parse(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
